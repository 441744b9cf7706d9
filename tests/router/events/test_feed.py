"""The event feed applied notice by notice: what each one does to a real prefix index, the
snapshot resync with batches held meanwhile, and bad snapshots (the subscriber is never
started: the test hands the feed its notices in stream order)."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from indexer.events import Batch, Cleared, Event, Removed, Stored
from indexer.index import PrefixIndex
from indexer.wire import BlockStored, KVEventBatch, encode_batch
from router.events.feed import EventFeed, SnapshotFetch
from router.events.subscriber import (
    Delivered,
    GapDetected,
    HistoryLost,
    MalformedInput,
    Restarted,
)
from tests.support.eventually import eventually

BS = 4
WORKER = 7


def stored(*hashes: int, parent: int | None = None) -> Stored:
    """A chain of blocks, each with its own tokens."""
    tokens: list[int | str] = [h * 10 + i for h in hashes for i in range(BS)]
    return Stored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens,
                  block_size=BS)


def delivered(seq: int, *events: Event, replayed: bool = False, ts: float = 0.0) -> Delivered:
    return Delivered(seq, Batch(ts, list(events)), replayed)


def snapshot(seq: int, *hashes: int) -> dict[str, Any]:
    """A ``/kv/snapshot`` answer re-stating ``hashes`` as one chain."""
    tokens: list[int | str] = [h * 10 + i for h in hashes for i in range(BS)]
    event = BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=tokens,
                        block_size=BS, lora_id=None, medium="GPU", lora_name=None, group_idx=0)
    payload = encode_batch(KVEventBatch(0.0, [event], 0))
    return {"seq": seq, "payload_b64": base64.b64encode(payload).decode()}


class Fed:
    """A feed for worker 7 over a real index, and what it reported."""

    def __init__(self, fetch: SnapshotFetch | None = None, index: Any = None) -> None:
        self.index = PrefixIndex(BS)
        self.cleared: list[int] = []
        self.applied: list[tuple[int, list[Event]]] = []
        self.counters: dict[str, float] = {}
        self.feed = EventFeed(WORKER, index or self.index, "tcp://127.0.0.1:9", None,
                              fetch_snapshot=fetch, on_cleared=self.cleared.append,
                              counters=self.counters,
                              on_events=lambda w, events: self.applied.append((w, events)))

    def held(self) -> set[int]:
        """The engine hashes the index holds for the worker."""
        return set(self.index.engine_hashes(WORKER))


@pytest.fixture
async def fed() -> AsyncIterator[Callable[..., Fed]]:
    made: list[Fed] = []

    def make(fetch: SnapshotFetch | None = None, index: Any = None) -> Fed:
        made.append(Fed(fetch, index))
        return made[-1]

    yield make
    for f in made:
        await f.feed.stop()


class Gate:
    """A snapshot source that answers when the test opens it."""

    def __init__(self, answer: dict[str, Any] | Exception) -> None:
        self.answer = answer
        self.opened = asyncio.Event()
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        await self.opened.wait()
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_delivered_batches_are_applied_in_stream_order(fed: Callable[..., Fed]) -> None:
    f = fed()
    f.feed.on_notice(delivered(0, stored(1, 2), ts=time.time() - 5))
    f.feed.on_notice(delivered(1, Removed(block_hashes=[2]), stored(3, parent=1),
                               replayed=True))
    assert f.held() == {1, 3}
    assert [w for w, _ in f.applied] == [WORKER, WORKER]
    assert f.counters == {"batches": 2, "replayed": 1}
    assert f.cleared == []
    f.feed.on_notice(delivered(2, stored(4), ts=time.time() + 60))  # a clock ahead: no lag
    assert f.feed.last_lag == 0.0


async def test_a_batch_lag_is_now_minus_its_timestamp(fed: Callable[..., Fed]) -> None:
    f = fed()
    f.feed.on_notice(delivered(0, stored(1), ts=time.time() - 5))
    assert f.feed.last_lag >= 5  # at least the 5 s the batch was stamped in the past


async def test_a_clear_in_a_batch_clears_in_stream_order(fed: Callable[..., Fed]) -> None:
    f = fed()
    f.feed.on_notice(delivered(0, stored(1, 2)))
    f.feed.on_notice(delivered(1, stored(3), Cleared(), stored(4)))
    assert f.held() == {4}  # what came before the clear is gone, what came after stays
    assert f.cleared == [WORKER]  # so the router forgets its predictions too


async def test_a_restart_clears_the_worker_and_gaps_and_garbage_are_counted(
        fed: Callable[..., Fed]) -> None:
    f = fed()
    f.feed.on_notice(delivered(0, stored(1)))
    f.feed.on_notice(GapDetected(expected=1, received=3))
    f.feed.on_notice(MalformedInput(seq=3, reason="not msgpack"))
    assert f.held() == {1}  # neither changes the index
    f.feed.on_notice(Restarted(last_seq=3, seq=0))
    assert f.held() == set() and f.cleared == [WORKER]
    assert f.counters == {"batches": 1, "gaps": 1, "malformed": 1, "restarts": 1}


async def test_lost_history_without_a_snapshot_clears_and_relearns(
        fed: Callable[..., Fed]) -> None:
    f = fed()
    f.feed.on_notice(delivered(0, stored(1, 2)))
    f.feed.on_notice(HistoryLost(first_missing=1, resumed_at=9, reason="replay ended"))
    assert f.held() == set() and f.cleared == [WORKER] and not f.feed.resyncing
    f.feed.on_notice(delivered(9, stored(5)))  # learned again from the stream
    assert f.held() == {5}
    assert (f.counters["history_lost"], f.counters["resyncs"]) == (1, 1)


async def test_lost_history_is_resynced_from_the_snapshot_with_later_batches_kept(
        fed: Callable[..., Fed]) -> None:
    gate = Gate(snapshot(5, 10, 11))
    f = fed(gate)
    f.feed.on_notice(delivered(0, stored(1)))
    f.feed.on_notice(HistoryLost(first_missing=1, resumed_at=None, reason="gap too large"))
    f.feed.on_notice(HistoryLost(first_missing=1, resumed_at=None, reason="again"))
    await eventually(lambda: gate.calls == 1, "the snapshot asked for")
    assert f.feed.resyncing and gate.calls == 1  # one fetch for both notices
    f.feed.on_notice(delivered(5, stored(20)))  # covered by the snapshot (seq 5)
    f.feed.on_notice(delivered(6, stored(30)))  # after it
    assert f.held() == {1}, "held while the snapshot is fetched"
    gate.opened.set()
    await asyncio.wait_for(f.feed._resync, 10)  # type: ignore[arg-type]
    assert f.held() == {10, 11, 30}
    assert not f.feed.resyncing
    assert f.cleared == [WORKER]
    assert (f.counters["snapshots"], f.counters["resyncs"]) == (1, 2)


@pytest.mark.parametrize("answer", [
    {"seq": 5, "payload_b64": base64.b64encode(b"\xc1 not msgpack").decode()},
    {"seq": "five", "payload_b64": ""},
    {"payload_b64": ""},
    OSError("connection reset"),
    RuntimeError("any client's error"),
])
async def test_an_unusable_snapshot_clears_and_keeps_every_held_batch(
        fed: Callable[..., Fed], answer: dict[str, Any] | Exception) -> None:
    gate = Gate(answer)
    f = fed(gate)
    f.feed.on_notice(delivered(0, stored(1)))
    f.feed.on_notice(HistoryLost(first_missing=1, resumed_at=None, reason="gap"))
    await eventually(lambda: gate.calls == 1, "the snapshot asked for")
    f.feed.on_notice(delivered(2, stored(30)))
    gate.opened.set()
    await asyncio.wait_for(f.feed._resync, 10)  # type: ignore[arg-type]
    assert f.held() == {30} and f.cleared == [WORKER]
    assert f.counters["snapshot_failures"] == 1 and "snapshots" not in f.counters


async def test_an_index_that_rejects_a_batch_is_counted_and_the_feed_goes_on(
        fed: Callable[..., Fed]) -> None:
    class FailsOnce:
        """The real index, but its first apply raises (a bug, not bad input)."""

        def __init__(self, index: Any) -> None:
            self.index, self.failed = index, False

        def apply_batch(self, worker: int, events: list[Event]) -> None:
            if not self.failed:
                self.failed = True
                raise RuntimeError("a bug in the index")
            self.index.apply_batch(worker, events)

        def clear(self, worker: int) -> None:
            self.index.clear(worker)

    real = PrefixIndex(BS)
    f = fed(index=FailsOnce(real))
    f.index = real
    f.feed.on_notice(delivered(0, stored(1)))
    f.feed.on_notice(delivered(1, stored(2)))
    assert f.held() == {2}
    assert f.counters["apply_errors"] == 1
    assert len(f.applied) == 2  # the pressure tracker still hears of both


async def test_stopping_the_feed_cancels_a_resync_in_flight(fed: Callable[..., Fed]) -> None:
    gate = Gate(snapshot(1, 10))
    f = fed(gate)
    f.feed.on_notice(HistoryLost(first_missing=0, resumed_at=None, reason="gap"))
    await eventually(lambda: gate.calls == 1, "the snapshot asked for")
    assert f.feed.resyncing
    await f.feed.stop()
    assert not f.feed.resyncing and f.held() == set()


def ranked(seq: int, rank: int | None, *events: Event) -> Delivered:
    return Delivered(seq, Batch(0.0, list(events), rank), False)


async def test_each_batch_goes_to_its_data_parallel_rank(fed: Callable[..., Fed]) -> None:
    f = fed()
    f.feed.ranks = [WORKER, 20, 21]  # rank 0 is the worker itself, ranks 1 and 2 ids 20, 21
    f.feed.on_notice(ranked(0, 0, stored(1)))
    f.feed.on_notice(ranked(1, 2, stored(2)))
    f.feed.on_notice(ranked(2, None, stored(3)))  # no rank named: rank 0
    f.feed.on_notice(ranked(3, 1, stored(4), Removed(block_hashes=[4])))
    assert f.held() == {1, 3}
    assert set(f.index.engine_hashes(21)) == {2} and set(f.index.engine_hashes(20)) == set()
    assert [w for w, _ in f.applied] == [WORKER, 21, WORKER, 20]
    # A rank the worker does not have: counted and skipped, the stream goes on.
    f.feed.on_notice(ranked(4, 3, stored(5)))
    f.feed.on_notice(ranked(5, -1, stored(6)))
    assert f.counters["unknown_rank"] == 2 and f.held() == {1, 3}
    # A clear names one rank and clears that rank; a restart clears them all.
    f.feed.on_notice(ranked(6, 2, Cleared()))
    assert set(f.index.engine_hashes(21)) == set() and f.held() == {1, 3}
    assert f.cleared == [21]
    f.feed.on_notice(ranked(7, 1, stored(7)))
    f.feed.on_notice(Restarted(7, 0))
    assert f.cleared == [21, WORKER, 20, 21]
    assert f.held() == set() and set(f.index.engine_hashes(20)) == set()


async def test_a_worker_of_one_rank_takes_any_rank_it_names(fed: Callable[..., Fed]) -> None:
    f = fed()  # a server run as rank 3 of a deployment of one server per rank
    f.feed.on_notice(ranked(0, 3, stored(1)))
    assert f.held() == {1} and "unknown_rank" not in f.counters
