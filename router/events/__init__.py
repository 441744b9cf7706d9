"""The event plane: KV events from each worker into the prefix index.

``transport`` (socket options, CURVE) and ``subscriber`` own the ZeroMQ sockets;
``sequencer`` is the pure state machine that orders batches, spots gaps and asks for
replays; ``feed`` applies what the sequencer releases to the index and reports notices.
"""
