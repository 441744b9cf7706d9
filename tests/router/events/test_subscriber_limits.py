"""The subscriber against hostile or broken publishers, over real sockets on 127.0.0.1: an
oversize message, and a replay socket that never covers a gap."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import zmq
import zmq.asyncio

from indexer.wire import (
    REPLAY_END_SEQ,
    BlockRemoved,
    KVEventBatch,
    encode_batch,
    pack_seq,
    unpack_seq,
)
from router.events.subscriber import Delivered, EventSubscriber, HistoryLost
from router.events.transport import EventTransport
from tests.support.eventually import eventually
from workers.cache.publisher import EventPublisher

ANY_PORT = "tcp://127.0.0.1:*"


def batch(i: int, blocks: int = 1) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockRemoved(block_hashes=list(range(i, i + blocks)),
                                                medium="GPU", group_idx=0)], 0)


def delivered_seqs(log: Any) -> list[int]:
    return [n.seq for n in log.of(Delivered)]


async def send_until(pub: zmq.asyncio.Socket, log: Any, first_seq: int,
                     predicate: Any) -> int:
    """Send good batches from ``first_seq`` on until ``predicate`` holds; returns the next
    seq to send."""
    seqs = itertools.count(first_seq)

    async def send_one() -> bool:
        if predicate():
            return True
        seq = next(seqs)
        await pub.send_multipart([b"", pack_seq(seq), encode_batch(batch(seq))])
        return False

    await eventually(send_one, "the subscriber to see the batches", interval=0.05)
    return next(seqs)


async def test_an_oversize_message_is_dropped_counted_and_the_stream_goes_on(
        notice_log: Any) -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(ANY_PORT)
    log = notice_log()
    limit = 64 * 1024
    sub = EventSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT), log,
                          transport=EventTransport(max_message_bytes=limit))
    await sub.start()
    try:
        seq = await send_until(pub, log, 0, lambda: bool(log.of(Delivered)))
        big = encode_batch(batch(2**40, blocks=20_000))  # a valid batch of ~180 KB
        assert len(big) > limit
        oversize_seq = seq
        await pub.send_multipart([b"", pack_seq(oversize_seq), big])
        seq = await send_until(pub, log, oversize_seq + 1,
                               lambda: delivered_seqs(log)[-1] > oversize_seq)
    finally:
        await sub.stop()
        pub.close(linger=0)
        ctx.term()
    assert sub.stats.oversize == 1
    assert oversize_seq not in delivered_seqs(log), "the oversize batch was never taken in"
    # the batches lost with the connection are a gap; without replay, history lost
    assert [n.first_missing for n in log.of(HistoryLost)] == [oversize_seq]


class EndOnlyReplay:
    """A replay ROUTER that answers every request with the end marker only, and counts."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ANY_PORT)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests: list[int] = []
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, _, start = await self.sock.recv_multipart()
            self.requests.append(unpack_seq(start))
            await self.sock.send_multipart([identity, b"", b"", REPLAY_END_SEQ, b""])

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sock.close(linger=0)


async def test_a_replay_that_never_covers_a_gap_is_asked_a_bounded_number_of_times(
        notice_log: Any) -> None:
    pub = EventPublisher(ANY_PORT, None)
    await pub.start()
    ctx = zmq.asyncio.Context()
    replay = EndOnlyReplay(ctx)
    log = notice_log()
    sub = EventSubscriber(pub.endpoint, log, replay_endpoint=replay.endpoint,
                          probe_interval=None, retry_delay=0.02, max_retry_delay=0.1,
                          max_replay_attempts=5)
    await sub.start()
    try:
        blocks = itertools.count()

        async def publish_one() -> bool:
            if log.of(Delivered):
                return True
            await pub.publish(batch(next(blocks)))
            return False

        await eventually(publish_one, "the subscription live", interval=0.05)
        first_missing = pub.next_seq
        pub.drop_next(3)
        for i in range(4):
            await pub.publish(batch(1000 + i))
        jumped_to = first_missing + 3
        await log.wait_for(lambda _: jumped_to in delivered_seqs(log), timeout=5.0,
                           what="the held batch, applied")
    finally:
        await sub.stop()
        await replay.close()
        await pub.close()
        ctx.term()
    assert replay.requests == [first_missing] * 5
    assert log.of(HistoryLost) == [HistoryLost(first_missing, jumped_to,
                                               "replay did not cover the gap")]
    assert sub.stats.replay_retries == 4
