"""What a hostile or broken publisher costs the router's subscriber.

Run: ``python -m bench.event_faults [--json] [--frames N] [--frame-mb MB]``.

Two scenarios, each against :class:`router.events.subscriber.EventSubscriber` on 127.0.0.1:

- ``oversize``: a PUB socket in a child process sends ``--frames`` frames of ``--frame-mb``
  MB each (after a good batch), once to a subscriber with the default message limit and once
  to one whose limit is above the frames (the behaviour without a limit). Printed: the
  subscriber process's peak RSS growth and the longest stall of a 10 ms heartbeat on its event
  loop (what ``/health`` would see in the router).
- ``replay_loop``: the live seq jumps while the replay socket answers only its end marker.
  Printed: the replay requests in a 2 s window and whether the held batch was applied.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import resource
import time
from typing import Any

import zmq
import zmq.asyncio

from indexer.wire import REPLAY_END_SEQ, BlockRemoved, KVEventBatch, encode_batch, pack_seq
from router.events.subscriber import Delivered, EventSubscriber
from router.events.transport import DEFAULT_MAX_MESSAGE_BYTES, EventTransport
from workers.cache.publisher import EventPublisher


def _batch(i: int) -> bytes:
    return encode_batch(KVEventBatch(float(i), [BlockRemoved(block_hashes=[i], medium="GPU",
                                                             group_idx=0)], 0))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def oversize(frames: int, frame_mb: int, limit: int) -> dict[str, float]:
    """Peak RSS growth and the longest event-loop stall while ``frames`` big frames arrive."""
    ctx = zmq.asyncio.Context()
    probe = ctx.socket(zmq.PUB)  # finds a free port for the child's PUB to bind
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    ctx.term()
    endpoint = f"tcp://127.0.0.1:{port}"
    seen: list[Any] = []
    sub = EventSubscriber(endpoint, seen.append, transport=EventTransport(max_message_bytes=limit))
    go = multiprocessing.Event()
    child = multiprocessing.Process(target=_serve, args=(port, frames, frame_mb, go))
    child.start()
    await sub.start()
    before = _rss_mb()
    stall, last = 0.0, time.monotonic()
    deadline = last + 60
    while child.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        now = time.monotonic()
        stall, last = max(stall, now - last - 0.01), now
        if seen:
            go.set()
    for _ in range(100):  # let the tail arrive
        await asyncio.sleep(0.01)
        now = time.monotonic()
        stall, last = max(stall, now - last - 0.01), now
    child.join(5)
    await sub.stop()
    return {"limit_mb": limit / 2**20, "rss_growth_mb": round(_rss_mb() - before),
            "max_loop_stall_s": round(stall, 3), "oversize_counted": sub.stats.oversize}


def _serve(port: int, frames: int, frame_mb: int, go: Any) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 5000)
    pub.bind(f"tcp://127.0.0.1:{port}")
    big = b"\0" * (frame_mb * 2**20)
    seq = 0
    while not go.is_set() and seq < 1000:  # until the subscriber has the stream
        pub.send_multipart([b"", pack_seq(seq), _batch(seq)])
        seq += 1
        time.sleep(0.01)
    for _ in range(frames):
        pub.send_multipart([b"", pack_seq(seq), big], copy=False)
        seq += 1
    pub.close()
    ctx.term()


async def replay_loop(window: float = 2.0) -> dict[str, Any]:
    """Replay requests in ``window`` seconds after a gap the replay socket never covers."""
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    await pub.start()
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    requests = 0

    async def answer_end_only() -> None:
        nonlocal requests
        while True:
            identity, _, _ = await router.recv_multipart()
            requests += 1
            await router.send_multipart([identity, b"", b"", REPLAY_END_SEQ, b""])

    server = asyncio.create_task(answer_end_only())
    seen: list[Any] = []
    sub = EventSubscriber(pub.endpoint, seen.append, probe_interval=None,
                          replay_endpoint=router.getsockopt_string(zmq.LAST_ENDPOINT))
    await sub.start()
    for i in range(300):
        await pub.publish(KVEventBatch(float(i), [], 0))
        await asyncio.sleep(0.01)
        if seen:
            break
    pub.drop_next(3)
    for _ in range(4):
        await pub.publish(KVEventBatch(0.0, [], 0))
    last = pub.next_seq - 1
    await asyncio.sleep(window)
    applied = any(isinstance(n, Delivered) and n.seq == last for n in seen)
    await sub.stop()
    server.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await server
    router.close()
    ctx.term()
    await pub.close()
    return {"window_s": window, "replay_requests": requests, "held_batch_applied": applied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--frame-mb", type=int, default=128)
    args = parser.parse_args()
    results = {
        "replay_loop": asyncio.run(replay_loop()),
        "oversize_limited": asyncio.run(oversize(args.frames, args.frame_mb,
                                                 DEFAULT_MAX_MESSAGE_BYTES)),
        "oversize_unlimited": asyncio.run(oversize(args.frames, args.frame_mb,
                                                   (args.frame_mb + 1) * 2**20)),
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, figures in results.items():
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
