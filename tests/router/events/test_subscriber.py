"""Publisher and subscriber over real ZeroMQ sockets on 127.0.0.1: order, loss, replay,
history loss, restarts, garbage."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from indexer.wire import BlockRemoved, KVEventBatch, encode_batch, pack_seq
from router.events.subscriber import (
    Delivered,
    EventSubscriber,
    GapDetected,
    HistoryLost,
    MalformedInput,
    Restarted,
)
from tests.support.eventually import eventually
from workers.cache.publisher import EventPublisher

ANY_PORT = "tcp://127.0.0.1:*"


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockRemoved(block_hashes=[i], medium="GPU", group_idx=0)], 0)


def live_seen(log: Any) -> bool:
    return any(not n.replayed for n in log.of(Delivered))


def delivered_seqs(log: Any) -> list[int]:
    return [n.seq for n in log.of(Delivered)]


def block_of(notice: Delivered) -> int:
    return notice.batch.events[0].block_hashes[0]


@pytest.fixture
async def publisher() -> Any:
    pub = EventPublisher(ANY_PORT, ANY_PORT, topic="kv", buffer_batches=1000)
    await pub.start()
    yield pub
    await pub.close()


async def publish_until_seen(pub: EventPublisher, log: Any, predicate: Any,
                             first_block: int = 0) -> None:
    """Publish batches until ``predicate`` holds: a SUB joins on its own schedule, and this
    waits for it without sleeping a fixed time."""
    blocks = itertools.count(first_block)

    async def publish_one() -> bool:
        if predicate():
            return True
        await pub.publish(batch(next(blocks)))
        return False

    await eventually(publish_one, "the subscriber to see the stream", interval=0.05)


async def subscribe(pub: EventPublisher, log: Any, **kwargs: Any) -> EventSubscriber:
    sub = EventSubscriber(pub.endpoint, log, replay_endpoint=pub.replay_endpoint, **kwargs)
    await sub.start()
    return sub


async def test_ordered_delivery_with_catch_up_from_zero(publisher: EventPublisher,
                                                        notice_log: Any) -> None:
    log = notice_log()
    for i in range(20):  # published before anyone listens: only replay can bring these
        await publisher.publish(batch(i))
    sub = await subscribe(publisher, log, from_seq=0)
    for i in range(20, 200):
        await publisher.publish(batch(i))
    await log.wait_for(lambda _: delivered_seqs(log)[-1:] == [199], what="seq 199")
    await sub.stop()
    assert delivered_seqs(log) == list(range(200))
    assert [block_of(n) for n in log.of(Delivered)] == list(range(200))
    assert not log.of(HistoryLost)


async def test_dropped_batches_are_recovered_by_replay(publisher: EventPublisher,
                                                       notice_log: Any) -> None:
    log = notice_log()
    sub = await subscribe(publisher, log, from_seq=0)
    await publish_until_seen(publisher, log, lambda: live_seen(log))
    first_dropped = publisher.next_seq
    publisher.drop_next(5)  # these 5 never reach the socket
    for i in range(first_dropped, first_dropped + 20):
        await publisher.publish(batch(i))
    last = first_dropped + 19
    await log.wait_for(lambda _: delivered_seqs(log)[-1:] == [last], what="last seq")
    await sub.stop()
    assert publisher.withheld == 5
    assert delivered_seqs(log) == list(range(last + 1)), "nothing missing, nothing doubled"
    assert [block_of(n) for n in log.of(Delivered)] == list(range(last + 1))
    gaps = log.of(GapDetected)
    assert gaps and gaps[0] == GapDetected(expected=first_dropped, received=first_dropped + 5)
    replayed = {n.seq for n in log.of(Delivered) if n.replayed}
    assert replayed >= set(range(first_dropped, first_dropped + 5))
    assert not log.of(HistoryLost)


async def test_tiny_high_water_mark_overflow_loses_nothing(notice_log: Any) -> None:
    pub = EventPublisher(ANY_PORT, ANY_PORT, hwm=1, buffer_batches=5000)
    await pub.start()
    log = notice_log()
    # Full test runs lost 1,000-1,050 and 1,500-1,551 here: the catch-up replay overran the
    # replay ROUTER's send pipe (1,000 messages) and the ROUTER dropped the rest; the pipe now
    # holds a whole replay (tests/workers/cache/test_publisher_replay.py). The other path that
    # drops batches is a replay outlasting ``replay_timeout`` (2 s by default), and this flood
    # keeps the loop that serves both ends busy: give the replay time.
    sub = await subscribe(pub, log, from_seq=0, replay_timeout=30.0)
    payload_events = [BlockRemoved(block_hashes=list(range(200)), medium="GPU", group_idx=0)]
    for i in range(2000):
        await pub.publish(KVEventBatch(float(i), payload_events, 0))
    await log.wait_for(lambda _: delivered_seqs(log)[-1:] == [1999], timeout=20,
                       what="seq 1999")
    await sub.stop()
    await pub.close()
    assert delivered_seqs(log) == list(range(2000))
    assert not log.of(HistoryLost)


async def test_loss_beyond_the_replay_buffer_is_history_lost(notice_log: Any) -> None:
    pub = EventPublisher(ANY_PORT, ANY_PORT, buffer_batches=3)
    await pub.start()
    log = notice_log()
    sub = await subscribe(pub, log, from_seq=0)
    await publish_until_seen(pub, log, lambda: live_seen(log))
    before = delivered_seqs(log)
    first = pub.next_seq
    pub.drop_next(10)  # 10 withheld; the buffer keeps only the last 3 batches
    for i in range(first, first + 12):
        await pub.publish(batch(i))
    await log.wait_for(lambda _: delivered_seqs(log)[-1:] == [first + 11], what="last seq")
    await sub.stop()
    await pub.close()
    lost = log.of(HistoryLost)
    assert len(lost) == 1
    assert (lost[0].first_missing, lost[0].resumed_at) == (first, first + 9)
    assert delivered_seqs(log) == [*before, first + 9, first + 10, first + 11]


async def test_gap_without_replay_endpoint_is_history_lost(notice_log: Any) -> None:
    pub = EventPublisher(ANY_PORT, None)
    await pub.start()
    log = notice_log()
    sub = EventSubscriber(pub.endpoint, log)
    await sub.start()
    await publish_until_seen(pub, log, lambda: bool(log.of(Delivered)))
    first = delivered_seqs(log)[0]
    pub.drop_next(2)
    for i in range(3):
        await pub.publish(batch(100 + i))
    await log.wait_for(lambda _: delivered_seqs(log)[-1] == pub.next_seq - 1, what="last seq")
    await sub.stop()
    await pub.close()
    assert log.of(HistoryLost)[0].reason == "no replay endpoint"
    assert delivered_seqs(log)[-1] == pub.next_seq - 1 and first < pub.next_seq - 3


async def test_restarted_publisher_is_reported_and_its_history_replayed(
        notice_log: Any) -> None:
    old = EventPublisher(ANY_PORT, ANY_PORT)
    await old.start()
    log = notice_log()
    sub = await subscribe(old, log, from_seq=0)
    for i in range(5):
        await old.publish(batch(i))
    await log.wait_for(lambda _: delivered_seqs(log)[-1:] == [4], what="seq 4")
    endpoint, replay = old.endpoint, old.replay_endpoint
    await old.close()
    new = EventPublisher(endpoint, replay)  # same addresses, seq back at 0
    await new.start()
    await publish_until_seen(new, log, lambda: bool(log.of(Restarted)), first_block=1000)
    last = new.next_seq - 1
    await log.wait_for(lambda _: len(log.of(Delivered)) == 5 + last + 1,
                       what="every batch of the new instance")
    await sub.stop()
    await new.close()
    restarts = log.of(Restarted)
    assert len(restarts) == 1 and restarts[0].last_seq == 4
    after = [n for n in log.of(Delivered)][5:]
    assert [n.seq for n in after] == list(range(last + 1)), "new instance replayed from 0"
    assert [block_of(n) for n in after] == [1000 + s for s in range(last + 1)]


async def test_garbage_frames_do_not_stop_the_subscriber(notice_log: Any) -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(ANY_PORT)
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    log = notice_log()
    sub = EventSubscriber(endpoint, log)
    await sub.start()
    good = encode_batch(batch(0))
    seqs = itertools.count()

    async def send_good() -> bool:
        if log.of(Delivered):
            return True
        await pub.send_multipart([b"", pack_seq(next(seqs)), good])
        return False

    await eventually(send_good, "the subscription live", interval=0.02)
    seq = next(seqs)
    garbage = [
        [b"only-one-frame"],
        [b"", b"1234567", good],  # 7-byte seq
        [b"", pack_seq(seq), b"\xc1\xc1"],  # not msgpack: counted, its seq not taken
        [b"", pack_seq(seq + 1), encode_batch(batch(1))[:-3]],  # truncated
    ]
    for frames in garbage:
        await pub.send_multipart(frames)
    await pub.send_multipart([b"", pack_seq(seq), encode_batch(batch(7))])
    await log.wait_for(lambda _: any(block_of(n) == 7 for n in log.of(Delivered)),
                       what="the good batch after the garbage")
    await sub.stop()
    pub.close(linger=0)
    ctx.term()
    assert len(log.of(MalformedInput)) == 4
    assert sub.stats.malformed == 4
    assert not log.of(GapDetected)


async def test_replay_router_ignores_malformed_requests(publisher: EventPublisher,
                                                        notice_log: Any) -> None:
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    await dealer.send_multipart([b"", b"short"])
    await dealer.send_multipart([b"not-empty", pack_seq(0)])
    await publisher.publish(batch(0))
    await dealer.send_multipart([b"", pack_seq(0)])
    reply = [await dealer.recv_multipart(), await dealer.recv_multipart()]
    dealer.close(linger=0)
    ctx.term()
    assert reply[0] == [b"", b"kv", pack_seq(0), encode_batch(batch(0))]
    assert reply[1] == [b"", b"", b"\xff" * 8, b""]
    assert publisher.bad_replay_requests == 2


async def test_stop_leaves_no_task_behind(publisher: EventPublisher, notice_log: Any) -> None:

    before = {t.get_name() for t in asyncio.all_tasks()}
    sub = await subscribe(publisher, notice_log())
    await sub.stop()
    await sub.stop()  # twice is fine
    assert {t.get_name() for t in asyncio.all_tasks()} == before


@contextlib.asynccontextmanager
async def silent_replay(log: Any, **kwargs: Any) -> AsyncIterator[
        tuple[EventPublisher, EventSubscriber]]:
    """A live publisher, a replay endpoint that takes requests and never answers (a replay port
    that is wrong, firewalled or hung), and a subscriber of both; all closed on the way out,
    pass or fail."""
    pub = EventPublisher(ANY_PORT, None)
    await pub.start()
    ctx = zmq.asyncio.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(ANY_PORT)
    sub = EventSubscriber(pub.endpoint, log,
                          replay_endpoint=silent.getsockopt_string(zmq.LAST_ENDPOINT), **kwargs)
    try:
        await sub.start()
        yield pub, sub
    finally:
        await sub.stop()
        await pub.close()
        silent.close()
        ctx.term()


async def test_an_unanswered_probe_is_not_history_lost(notice_log: Any) -> None:
    # A probe checks for trailing loss on a quiet stream. If the replay endpoint never
    # answers, nothing is known to be lost: reporting history lost would make the router
    # drop or re-fetch that worker's index entries at every quiet spell.
    log = notice_log()
    async with silent_replay(log, probe_interval=0.05, replay_timeout=0.1) as (pub, sub):
        await publish_until_seen(pub, log, lambda: bool(log.of(Delivered)))
        await eventually(lambda: sub.stats.probe_timeouts >= 2, "two unanswered probes")
        assert not log.of(HistoryLost)
        last = sub.last_seq
        assert last is not None
        await pub.publish(batch(500))  # the stream goes on where it was
        await log.wait_for(lambda _: delivered_seqs(log)[-1] == last + 1, what="the next batch")
    assert not log.of(HistoryLost) and not log.of(GapDetected)
    assert sub.stats.probes >= sub.stats.probe_timeouts >= 2


async def test_an_unanswered_replay_of_a_gap_is_history_lost(notice_log: Any) -> None:
    log = notice_log()
    async with silent_replay(log, probe_interval=None, replay_timeout=0.2) as (pub, _sub):
        await publish_until_seen(pub, log, lambda: bool(log.of(Delivered)))
        first_dropped = pub.next_seq
        pub.drop_next(3)
        for i in range(5):
            await pub.publish(batch(300 + i))
        await log.wait_for(lambda _: bool(log.of(HistoryLost)), what="history lost")
        await log.wait_for(lambda _: delivered_seqs(log)[-1] == first_dropped + 4,
                           what="the held batches")
    (lost,) = log.of(HistoryLost)
    assert (lost.first_missing, lost.resumed_at, lost.reason) == (
        first_dropped, first_dropped + 3, "replay timed out")
    assert delivered_seqs(log)[-2:] == [first_dropped + 3, first_dropped + 4]


async def test_a_batch_that_continues_the_stream_ends_a_probe_at_once(notice_log: Any) -> None:
    # While a probe waits for its answer, live batches are held back; one that continues the
    # stream proves nothing was lost, so it is delivered without waiting out the probe.
    log = notice_log()
    async with silent_replay(log, probe_interval=0.05, replay_timeout=30.0) as (pub, sub):
        await publish_until_seen(pub, log, lambda: bool(log.of(Delivered)))
        last = sub.last_seq
        assert last is not None
        await eventually(lambda: sub.stats.probes >= 1, "a probe in flight")
        await pub.publish(batch(600))
        await log.wait_for(lambda _: delivered_seqs(log)[-1] == last + 1, timeout=2.0,
                           what="the batch, well before the 30 s replay timeout")
    assert not log.of(HistoryLost) and sub.stats.probe_timeouts == 0
