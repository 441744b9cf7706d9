"""Fleet membership: which workers exist, what they are and whether they are healthy.

``registry`` holds the workers and polls them, each an ``entry``; ``discovery`` finds them by DNS;
``healthy`` keeps the list the routing core sees; ``worker_table``, ``worker_config`` and
``worker_answers`` are a worker's state, its configuration and its parsed control answers;
``engines`` adapts kvroute's own workers and stock vLLM, SGLang and TensorRT-LLM servers.
"""
