"""Health polling, one round at a time: a real registry against real HTTP workers on
127.0.0.1, driven by :meth:`Registry.poll_once` and a clock the test sets, so the grace and
the rounds never depend on how fast the machine is."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from indexer.index import PrefixIndex
from router.fleet.entry import FleetSettings
from router.fleet.facts import FleetFacts
from router.fleet.first_byte_waits import FirstByteWait
from router.fleet.registry import Registry
from router.fleet.worker_table import WorkerState
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker

GARBAGE = b"not json"
GOOD = b'{"running": 0, "waiting": 0}'


class Clock:
    """Seconds that move only when the test says."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _Cleared(FleetFacts):
    """Records the workers whose entries were dropped."""

    def __init__(self, into: list[int]) -> None:
        self.into = into

    def cleared(self, worker: int) -> None:
        self.into.append(worker)


@contextlib.asynccontextmanager
async def registry(clock: Clock, forgotten: list[int], **settings: Any
                   ) -> AsyncIterator[Registry]:
    """A registry that is never started: only the test's rounds poll."""
    async with httpx.AsyncClient() as http:
        reg = Registry(FleetSettings(**settings), PrefixIndex(32), _Cleared(forgotten),
                       "bytes-v1", http, clock=clock)
        try:
            yield reg
        finally:
            await reg.stop()


async def test_an_unhealthy_worker_keeps_its_entries_for_the_grace_then_loses_them() -> None:
    clock, forgotten = Clock(100.0), []
    async with ScriptedWorker() as worker, registry(clock, forgotten, unhealthy_grace=5.0) as reg:
        entry = await reg.add(worker.url)
        assert (entry.state, entry.indexed, reg.candidates()) == (WorkerState.HEALTHY, True,
                                                                  [entry])
        worker.load_answer = GARBAGE
        await reg.poll_once()  # t=100: out of the candidate set at once, entries kept
        assert (entry.state, entry.unhealthy_since, entry.indexed) == (
            WorkerState.UNHEALTHY, 100.0, True)
        assert reg.candidates() == [] and forgotten == []
        clock.now = 104.9
        await reg.poll_once()  # inside the grace: still kept
        assert entry.indexed and forgotten == []
        clock.now = 105.0
        await reg.poll_once()  # the grace has passed: the entries go
        assert (entry.indexed, forgotten) == (False, [entry.id])
        assert entry.counters["health_failures"] == 3
        worker.load_answer = GOOD
        await reg.poll_once()  # it answers again: described anew, a candidate again
        assert (entry.state, entry.unhealthy_since, entry.indexed, entry.last_error) == (
            WorkerState.HEALTHY, None, True, None)
        assert reg.candidates() == [entry]


async def test_a_hung_health_probe_gives_up_the_requests_waiting_for_a_first_byte() -> None:
    # The paused worker never answers, so each probe ends at health_timeout however loaded
    # the machine is; the waiting request has no deadline of its own: only the poll frees it.
    clock, forgotten = Clock(0.0), []
    async with (
        ScriptedWorker() as worker,
        registry(clock, forgotten, health_timeout=0.05, health_misses=3) as reg,
    ):
        entry = await reg.add(worker.url)

        async def wait_for_first_byte() -> None:
            with FirstByteWait() as wait, entry.waits.waiting(wait):  # no deadline of its own
                await asyncio.Event().wait()

        waiting = asyncio.create_task(wait_for_first_byte())
        await eventually(lambda: len(entry.waits) == 1, "the send registered")
        worker.pause()
        for late in (1, 2):  # late probes, short of health_misses: still a candidate
            clock.now += 10.0
            await reg.poll_once()
            assert entry.state is WorkerState.HEALTHY and not waiting.done()
            assert entry.counters["late_probes"] == late
        clock.now += 10.0
        await reg.poll_once()  # the third in a row: gone, and its waits end now
        assert entry.state is WorkerState.UNHEALTHY
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(waiting, 10)
        assert len(entry.waits) == 0
        assert "3 polls in a row" in (entry.last_error or ""), entry.last_error


async def test_a_bad_load_answer_takes_a_worker_out_but_gives_up_no_request() -> None:
    clock, forgotten = Clock(0.0), []
    async with ScriptedWorker() as worker, registry(clock, forgotten) as reg:
        entry = await reg.add(worker.url)

        async def wait_for_first_byte() -> None:
            with FirstByteWait() as wait, entry.waits.waiting(wait):  # no deadline of its own
                await asyncio.Event().wait()

        waiting = asyncio.create_task(wait_for_first_byte())
        await eventually(lambda: len(entry.waits) == 1, "the send registered")
        worker.load_answer = GARBAGE  # an answer, only a bad one: the worker is there
        await reg.poll_once()
        assert entry.state is WorkerState.UNHEALTHY
        assert not waiting.done() and len(entry.waits) == 1
        waiting.cancel()


async def test_a_worker_whose_check_hangs_delays_no_other_workers_check() -> None:
    clock, forgotten = Clock(0.0), []
    async with (
        ScriptedWorker() as slow,
        ScriptedWorker() as good,
        registry(clock, forgotten) as reg,
    ):
        slow_entry, good_entry = await reg.add(slow.url), await reg.add(good.url)
        slow.load_answer = GARBAGE
        await reg.poll_once()
        assert slow_entry.state is WorkerState.UNHEALTHY
        slow.load_answer = GOOD
        slow.hang_model_info()  # its next check reconnects, and that waits
        calls = slow.model_info_calls
        first = asyncio.create_task(reg.poll_once())
        await eventually(lambda: slow.model_info_calls == calls + 1, "the slow reconnect")
        good.load_answer = GARBAGE
        second = asyncio.create_task(reg.poll_once())  # the slow worker keeps its check
        await eventually(lambda: good_entry.state is WorkerState.UNHEALTHY,
                         "the other worker's check")
        # seen while the slow worker's one /model_info call still waits
        assert (slow.model_info_calls, slow.model_info_ended) == (calls + 1, calls)
        assert not first.done() and not second.done()  # a round waits for every check
        slow.resume()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert slow_entry.state is WorkerState.HEALTHY
