"""The engine over real ZeroMQ sockets on 127.0.0.1: a router-side subscriber sees its blocks,
resets, cancels, failures and a clean stop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from indexer.events import Cleared, Stored
from router.events.subscriber import Delivered, EventSubscriber
from workers.cache.block_keys import Prompt, RequestBlocks, wire_hash
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink
from workers.cache.publisher import EventPublisher
from workers.engine.batcher import Batcher, EngineRequest, Output
from workers.engine.executor import IterationPlan, SimExecutor
from workers.engine.loop import Engine, RequestFailed, RequestHandle

ANY_PORT = "tcp://127.0.0.1:*"
PROMPT = list(range(40, 50))  # 10 tokens: two full blocks of 4 and a partial one


class GatedExecutor:
    """A SimExecutor that waits at a gate before each iteration, so a test can act mid-flight."""

    def __init__(self) -> None:
        self.sim = SimExecutor(speedup=1e9, block_size=4)
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()
        self.fail_next = False

    async def execute(self, plan: IterationPlan) -> tuple[dict[str, int], float]:
        self.entered.set()
        await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost")
        return await self.sim.execute(plan)


@dataclass
class Rig:
    engine: Engine
    executor: GatedExecutor
    publisher: EventPublisher
    notices: Any

    def stored_hashes(self) -> list[int]:
        return [h for e in self.events() if isinstance(e, Stored) for h in e.block_hashes]

    def events(self) -> list[object]:
        return [e for n in self.notices.of(Delivered) for e in n.batch.events]

    async def seen(self, seq: int) -> None:
        await self.notices.wait_for(
            lambda items: any(isinstance(n, Delivered) and n.seq == seq for n in items),
            what=f"batch {seq}",
        )


@pytest.fixture
async def rig(notice_log: Any) -> AsyncIterator[Rig]:
    publisher = EventPublisher(ANY_PORT, ANY_PORT, topic="kv")
    await publisher.start()
    notices = notice_log()
    # Replaying from seq 0 at start covers batches sent before the SUB socket joined.
    subscriber = EventSubscriber(
        publisher.endpoint,
        notices,
        replay_endpoint=publisher.replay_endpoint,
        topic="kv",
        from_seq=0,
        probe_interval=0.05,
    )
    await subscriber.start()
    cache = CacheManager(num_blocks=16, block_size=4)
    executor = GatedExecutor()
    engine = Engine(cache, Batcher(cache), executor, EventSink(), publisher, rank=0)
    await engine.start()
    yield Rig(engine, executor, publisher, notices)
    await engine.stop()
    await subscriber.stop()
    await publisher.close()


def request(rid: str, tokens: list[int] = PROMPT, max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(rid, Prompt(tokens), max_tokens)


async def collect(handle: RequestHandle) -> list[Output]:
    return [o async for o in handle]


def block_hashes(tokens: list[int]) -> list[int]:
    blocks = RequestBlocks(Prompt(tokens), 4)
    return [wire_hash(blocks.block(i).key) for i in range(blocks.num_full_blocks)]


async def test_completed_request_blocks_are_published(rig: Rig) -> None:
    handle = rig.engine.submit(request("r1"))
    assert handle.prompt_tokens == 10
    outputs = await collect(handle)
    sim = rig.executor.sim
    tokens = [sim.token(Prompt(PROMPT), i) for i in range(3)]
    assert outputs == [
        Output("r1", tokens[0], 0),
        Output("r1", tokens[1], 1),
        Output("r1", tokens[2], 2, True, "length"),
    ]
    assert outputs[0].first and handle.num_cached_tokens == 0
    assert rig.engine.cache.pool.num_held_blocks == 0

    # Published before the last token was delivered: the prompt's two blocks when its
    # prefill was computed, then the block filled by the prompt's tail and two outputs.
    assert rig.publisher.next_seq == 2
    await rig.seen(1)
    assert rig.stored_hashes() == block_hashes([*PROMPT, *tokens[:2]])

    # The same prompt again hits both prompt blocks.
    again = rig.engine.submit(request("r2", max_tokens=1))
    assert await again.admitted() == 8
    assert [o.token_id for o in await collect(again)] == tokens[:1]

    stats = rig.engine.stats()
    assert (stats["finished"], stats["cache_hit_tokens"], stats["events_stored"]) == (2, 8, 3)
    assert stats["publisher_sent"] == 2 and stats["busy_seconds"] > 0

    seq, snapshot = rig.engine.snapshot()
    assert seq == rig.publisher.next_seq - 1
    assert [h for e in snapshot.events for h in e.block_hashes] == rig.stored_hashes()  # type: ignore[union-attr]


async def test_reset_publishes_cleared_before_returning(rig: Rig) -> None:
    await collect(rig.engine.submit(request("r1")))
    seq = rig.publisher.next_seq
    assert await rig.engine.reset_prefix_cache() is True
    assert rig.publisher.next_seq == seq + 1  # published, not merely queued
    await rig.seen(seq)
    assert isinstance(rig.events()[-1], Cleared)
    assert rig.engine.snapshot()[0] == seq and rig.engine.snapshot()[1].events == []
    assert rig.engine.cache.pool.num_cached_blocks == 0


async def test_reset_refused_and_cancel_frees_blocks_mid_flight(rig: Rig) -> None:
    engine, gate = rig.engine, rig.executor.gate
    gate.clear()
    handle = engine.submit(request("r1"))
    assert await handle.admitted() == 0
    await rig.executor.entered.wait()
    assert engine.load() == {
        "running": 1,
        "waiting": 0,
        "pending_prefill_tokens": 10,
        "decode_blocks": 0,
        "kv_usage": 3 / 16,
        "num_blocks": 16,
    }
    seq = rig.publisher.next_seq
    assert await engine.reset_prefix_cache() is False
    assert rig.publisher.next_seq == seq  # nothing published

    handle.cancel()
    handle.cancel()
    assert engine.cache.pool.num_held_blocks == 0
    assert await collect(handle) == []
    assert engine.load()["running"] == 0

    # The iteration in flight completes without the request; the engine keeps serving, and
    # the id is free again.
    gate.set()
    outputs = await collect(engine.submit(request("r1", max_tokens=2)))
    assert [o.index for o in outputs] == [0, 1]
    assert engine.stats()["aborted"] == 1


async def test_a_failed_iteration_recomputes_its_requests(rig: Rig) -> None:
    # The first pass of r1 fails; r1 goes back to the queue and is recomputed, and its
    # tokens are the ones a run without the failure gives.
    rig.executor.fail_next = True
    outputs = await collect(rig.engine.submit(request("r1")))
    assert [o.token_id for o in outputs] == [
        rig.executor.sim.token(Prompt(PROMPT), i) for i in range(3)]
    assert rig.engine.cache.pool.num_held_blocks == 0
    stats = rig.engine.stats()
    assert (stats["failed_iterations"], stats["failure_preemptions"]) == (1, 1)
    assert stats["failed_requests"] == 0


async def test_invalid_requests_change_nothing(rig: Rig) -> None:
    with pytest.raises(ValueError, match="maximum context length is 64"):
        rig.engine.submit(request("r1", list(range(60)), max_tokens=10))
    rig.executor.gate.clear()
    rig.engine.submit(request("r1"))
    with pytest.raises(ValueError, match="already queued"):
        rig.engine.submit(request("r1"))
    assert rig.engine.batcher.stats().admissions + rig.engine.batcher.waiting == 1


async def test_drop_next_batches_withholds_from_the_live_stream(rig: Rig) -> None:
    rig.engine.drop_next_batches(1)
    await collect(rig.engine.submit(request("r1")))
    assert (rig.publisher.withheld, rig.publisher.sent) == (1, 1)
    await rig.seen(1)  # the probe's replay recovers the withheld batch
    assert rig.stored_hashes()[:2] == block_hashes(PROMPT)


async def test_stop_ends_every_request_and_leaves_no_task() -> None:
    before = asyncio.all_tasks()
    cache = CacheManager(num_blocks=16, block_size=4)
    executor = GatedExecutor()
    executor.gate.clear()
    engine = Engine(cache, Batcher(cache), executor, EventSink(), None)
    await engine.start()
    running = engine.submit(request("r1"))
    await executor.entered.wait()
    waiting = engine.submit(request("r2"))
    await engine.stop()
    await engine.stop()

    assert asyncio.all_tasks() == before
    with pytest.raises(RequestFailed, match="engine stopped"):
        await collect(running)
    with pytest.raises(RequestFailed, match="ended before admission"):
        await waiting.admitted()
    assert cache.pool.num_held_blocks == 0 and engine.batcher.request_ids() == []
    assert engine.batcher.in_flight is None
    with pytest.raises(RuntimeError, match="stopped"):
        engine.submit(request("r3"))
    assert engine.snapshot()[0] == -1
