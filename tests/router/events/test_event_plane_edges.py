"""The event plane at its edges over real ZeroMQ sockets on 127.0.0.1: a publisher that sends
seqs out of range or bursts of bad frames, and a subscription whose task ends. The subscriber
keeps going, the index keeps what it learnt, and a stopped subscription marks its worker
unhealthy with the reason until it is subscribed again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from indexer.index import PrefixIndex
from indexer.wire import BlockStored, KVEventBatch, encode_batch, pack_seq
from router.events.feed import EventFeed
from router.events.subscriber import Delivered, EventSubscriber, MalformedInput
from router.fleet.facts import FleetFacts
from router.fleet.registry import Registry
from router.fleet.worker_table import WorkerState
from router.settings import RouterSettings
from tests.support.servers import ScriptedWorker
from workers.cache.publisher import EventPublisher

ANY_PORT = "tcp://127.0.0.1:*"
TOP = b"\xff" * 8  # seq 2**64 - 1


def stored(block: int) -> bytes:
    return encode_batch(KVEventBatch(float(block), [stored_event(block)], 0))


@pytest.fixture
async def rogue() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    """A bare PUB socket: whatever frames a test sends, as a rogue or buggy publisher would."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(ANY_PORT)
    yield pub, pub.getsockopt_string(zmq.LAST_ENDPOINT)
    pub.close(linger=0)
    ctx.term()


async def until(predicate: Any, what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def joined(pub: zmq.asyncio.Socket, seen: Any, seq: int = 0) -> int:
    """Send seq ``seq``, ``seq + 1``... until the subscriber has one (a SUB joins on its own
    schedule); returns the next seq."""
    for _ in range(500):
        await pub.send_multipart([b"", pack_seq(seq), stored(seq)])
        seq += 1
        await asyncio.sleep(0.01)
        if seen():
            return seq
    raise AssertionError("the subscriber never joined")


async def test_a_seq_out_of_range_leaves_the_subscriber_running(
        rogue: tuple[zmq.asyncio.Socket, str], notice_log: Any) -> None:
    # seq 2**64 - 1 used to be taken as the stream's position; the next probe then asked for
    # 2**64, which no frame can carry, and the subscriber's task died silently.
    pub, endpoint = rogue
    log = notice_log()
    # A replay endpoint that never answers: probes go out, and time out quietly.
    ctx = zmq.asyncio.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.bind(ANY_PORT)
    sub = EventSubscriber(endpoint, log, replay_endpoint=silent.getsockopt_string(
        zmq.LAST_ENDPOINT), probe_interval=0.02, replay_timeout=0.05)
    await sub.start()
    try:
        seq = await joined(pub, lambda: bool(log.of(Delivered)))
        await pub.send_multipart([b"", TOP, stored(99)])
        await until(lambda: sub.stats.malformed >= 1, "the bad seq counted")
        await until(lambda: sub.stats.probes >= 2, "probes after it")
        await pub.send_multipart([b"", pack_seq(seq), stored(seq)])
        await until(lambda: sub.last_seq == seq, "the stream going on")
        assert sub.failure is None
        (bad,) = [n for n in log.of(MalformedInput) if n.seq == 2**64 - 1]
        assert "out of range" in bad.reason
    finally:
        await sub.stop()
        silent.close(linger=0)
        ctx.term()


async def test_a_burst_of_bad_frames_wipes_nothing_and_stalls_nothing(
        rogue: tuple[zmq.asyncio.Socket, str]) -> None:
    pub, endpoint = rogue
    index = PrefixIndex(2)
    cleared: list[int] = []
    counters: dict[str, float] = {}
    feed = EventFeed(0, index, endpoint, None, fetch_snapshot=None, on_cleared=cleared.append,
                     counters=counters)
    await feed.start()
    try:
        seq = await joined(pub, lambda: index.worker_blocks(0)[0] > 0, seq=0)
        # Every batch sent after the join is delivered; those before it may not have been.
        await until(lambda: feed.subscriber.last_seq == seq - 1, "the join's last batch")
        held = index.worker_blocks(0)[0]
        burst = [
            [b"x"],
            [b"", pack_seq(seq)],
            [b"", b"\x00" * 7, stored(50)],
            [b"", pack_seq(seq), b"\xc1\xc1"],
            [b"", pack_seq(seq + 1), stored(51)[:-3]],
            [b"", pack_seq(seq + 900), b"\x93"],
            [b"", TOP, stored(52)],
        ]
        for frames in burst:
            await pub.send_multipart(frames)
        for block in (seq, seq + 1):
            await pub.send_multipart([b"", pack_seq(block), stored(block)])
        await until(lambda: index.worker_blocks(0) == (held + 2, 0),
                    "both batches after the burst")
    finally:
        await feed.stop()
    assert counters.get("malformed") == len(burst)
    assert cleared == [] and "restarts" not in counters and "history_lost" not in counters
    assert feed.subscriber.stats.gaps == 0


async def test_a_subscription_that_stops_marks_its_worker_unhealthy_until_resubscribed() -> None:
    settings = RouterSettings(unhealthy_grace=60.0)
    pub = EventPublisher(ANY_PORT, None)
    await pub.start()
    async with ScriptedWorker() as worker, httpx.AsyncClient() as http:
        worker.model_info_extra = {"events_endpoint": pub.endpoint}
        reg = Registry(settings.fleet_settings(), PrefixIndex(settings.block_size),
                       FleetFacts(), "bytes-v1", http)
        try:
            entry = await reg.add(worker.url)
            first = entry.feed
            assert first is not None and entry.state is WorkerState.HEALTHY
            # The socket under the subscriber goes away (as a terminated context would):
            # its task ends with an error.
            link = first.subscriber._sub
            assert link is not None
            link.sock.close(linger=0)
            await until(lambda: first.failure is not None, "the subscription to end")
            await reg.poll_once()
            assert entry.state is WorkerState.UNHEALTHY
            assert entry.last_error is not None
            assert entry.last_error.startswith(f"event subscriber for {pub.endpoint} stopped:")
            assert entry.counters["feed_failures"] == 1
            assert entry.feed is None
            await reg.poll_once()  # it answers: subscribed afresh
            assert entry.state is WorkerState.HEALTHY
            assert entry.feed is not None and entry.feed.failure is None
        finally:
            await reg.stop()
            await pub.close()


async def test_a_worker_holds_no_more_entries_than_its_capacity_allows() -> None:
    # The worker declares 4 device blocks; a rogue publisher on its event port stores 10,000.
    # Its view is bounded at twice the declared capacity (a block may sit on both tiers, and
    # events in flight lag behind evictions), and the excess is counted.
    pub = EventPublisher(ANY_PORT, None)
    await pub.start()
    index = PrefixIndex(2)
    async with ScriptedWorker(block_size=2) as worker, httpx.AsyncClient() as http:
        worker.model_info_extra = {"events_endpoint": pub.endpoint,
                                   "capacity": {"num_blocks": 4}}
        reg = Registry(RouterSettings(block_size=2, unhealthy_grace=60.0).fleet_settings(),
                       index, FleetFacts(), "bytes-v1", http)
        try:
            entry = await reg.add(worker.url)
            assert entry.feed is not None
            for block in range(200):  # until the subscription is live
                await pub.publish(KVEventBatch(0.0, [stored_event(block)], 0))
                await asyncio.sleep(0.01)
                if entry.counters.get("batches"):
                    break
            batch = [stored_event(1000 + b) for b in range(10_000)]
            await pub.publish(KVEventBatch(0.0, batch, 0))
            await until(lambda: entry.counters.get("over_capacity", 0) > 0, "the excess counted")
            assert sum(index.worker_blocks(entry.id)) == 8
            assert entry.counters["over_capacity"] >= 10_000 - 8
            assert entry.state is WorkerState.HEALTHY
        finally:
            await reg.stop()
            await pub.close()


def stored_event(block: int) -> BlockStored:
    return BlockStored(block_hashes=[block], parent_block_hash=None,
                       token_ids=[2 * block + 1, 2 * block + 2],
                       block_size=2, lora_id=None, medium="GPU", lora_name=None, group_idx=0)
