"""Failover on its own: a real router service and proxy in front of scripted workers on
127.0.0.1, one decided request sent through :func:`send_with_failover`. The worker tried first
is chosen by load (the others report deep queues), so the order never rests on a tie-break."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from openai_request.bodies import ApiError
from router.fleet.entry import WorkerEntry
from router.fleet.worker_table import WorkerState
from router.http.failover import MAX_ATTEMPTS, RETRY_PAUSE_S, send_with_failover
from router.http.first_byte import FirstByteClock
from router.http.proxy import Proxy, UpstreamAnswer, UpstreamUnavailable
from router.service import Route, RouterService
from router.settings import RouterSettings
from tests.support.servers import ScriptedWorker

BODY = {"model": "kvroute-sim", "prompt": "fail over " * 12, "max_tokens": 4}
HEADERS = {"Content-Type": "application/json"}
DEEP_QUEUE = b'{"running": 0, "waiting": 64, "pending_prefill_tokens": 1000000}'


class Blip(Proxy):
    """A proxy whose first ``failing`` sends fail to connect, as every new connection does
    while the network blips (a resolver answering nothing)."""

    def __init__(self, failing: int) -> None:
        super().__init__()
        self.failing = failing

    async def send(self, url: str, *args: Any, **kwargs: Any) -> UpstreamAnswer:
        if self.failing:
            self.failing -= 1
            raise UpstreamUnavailable(f"{url}: gaierror: Name or service not known", "connect")
        return await super().send(url, *args, **kwargs)


@contextlib.asynccontextmanager
async def routed(*workers: ScriptedWorker, proxy: Proxy | None = None
                 ) -> AsyncIterator[tuple[RouterService, Proxy]]:
    """A service with ``workers`` registered (no poll loop: the test polls) and a proxy."""
    settings = RouterSettings(workers=tuple(w.url for w in workers), seed=3)
    async with httpx.AsyncClient() as http:
        service = RouterService(settings, http)
        for worker in workers:
            await service.registry.add(worker.url)
        proxy = proxy or Proxy()
        await proxy.start()
        try:
            yield service, proxy
        finally:
            await service.registry.stop()
            await proxy.close()


async def decided(service: RouterService, first: ScriptedWorker, *busy: ScriptedWorker,
                  stream: bool = False) -> Route:
    """Decide one request after ``busy`` workers reported deep queues: ``first`` is chosen."""
    for worker in busy:
        worker.load_answer = DEEP_QUEUE
    await service.registry.poll_once()
    route = service.decide({**BODY, "stream": stream}, "completions")
    assert route.worker.url == first.url
    return route


def active(service: RouterService, worker: ScriptedWorker) -> int:
    """Requests the router has booked on ``worker`` (its own, not the worker's queue)."""
    entry = service.registry.find(worker.url)
    assert entry is not None
    return service.in_flight(entry)


async def send(service: RouterService, proxy: Proxy, route: Route, failures: list[Any], *,
               stream: bool = False, floor: float = 2.0, pauses: list[float] | None = None
               ) -> Any:
    def failed(worker: WorkerEntry, attempt: int, cause: str) -> None:
        failures.append((worker.url, attempt, cause))

    async def pause(seconds: float) -> None:  # no real wait: the test counts them
        (pauses if pauses is not None else []).append(seconds)

    body = json.dumps({**BODY, "stream": stream}).encode()
    return await send_with_failover(service, proxy, FirstByteClock(floor, 4.0, 300.0), route,
                                    "/v1/completions", body, HEADERS, stream, failed,
                                    pause=pause)


async def test_a_worker_failing_before_its_first_byte_hands_the_request_on() -> None:
    async with (
        ScriptedWorker("refuse") as bad,
        ScriptedWorker() as busy,
        routed(bad, busy) as (service, proxy),
    ):
        route = await decided(service, bad, busy)
        failures: list[Any] = []
        sent = await send(service, proxy, route, failures)
        assert (sent.worker.url, sent.attempt, sent.answer.status) == (busy.url, 1, 200)
        assert json.loads(await sent.answer.read())["choices"][0]["text"] == "ok"
        assert failures == [(bad.url, 0, "status")]
        # the booking moved with the request: withdrawn from the refusing worker
        assert (active(service, bad), active(service, busy)) == (0, 1)


async def test_the_fallbacks_are_priced_only_when_the_first_worker_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with (
        ScriptedWorker() as first,
        ScriptedWorker() as other,
        routed(first, other) as (service, proxy),
    ):
        route = await decided(service, first, other)
        priced: list[int] = []
        candidates = service.core.candidates
        monkeypatch.setattr(service.core, "candidates",
                            lambda workers, *a, **kw: priced.append(1)
                            or candidates(workers, *a, **kw))
        sent = await send(service, proxy, route, [])
        assert sent.worker.url == first.url and priced == []  # taken: nobody else priced
        await sent.answer.read()
        assert [w.url for w in route.ranked()] == [first.url, other.url]
        assert priced == [1]


async def test_no_more_than_max_attempts_workers_are_tried_then_503() -> None:
    async with contextlib.AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(ScriptedWorker("refuse"))
                   for _ in range(MAX_ATTEMPTS + 1)]
        service, proxy = await stack.enter_async_context(routed(*workers))
        route = await decided(service, workers[0], *workers[1:])
        failures: list[Any] = []
        pauses: list[float] = []
        with pytest.raises(ApiError) as refused:
            await send(service, proxy, route, failures, pauses=pauses)
        assert refused.value.status == 503
        assert f"tried {MAX_ATTEMPTS}" in str(refused.value)
        assert pauses == []  # workers that answered 5xx get no second round
        assert [attempt for _, attempt, _ in failures] == list(range(MAX_ATTEMPTS))
        assert sum(len(w.requests) for w in workers) == MAX_ATTEMPTS
        assert [active(service, w) for w in workers] == [0] * len(workers)


async def test_a_fallback_that_turned_unhealthy_since_the_decision_is_skipped() -> None:
    async with (
        ScriptedWorker("refuse") as bad,
        ScriptedWorker() as sick,
        ScriptedWorker() as good,
        routed(bad, sick, good) as (service, proxy),
    ):
        route = await decided(service, bad, sick, good)
        assert sick.url in [w.url for w in route.fallbacks()]
        sick.load_answer = b"not json"
        await service.registry.poll_once()
        sick_entry = service.registry.find(sick.url)
        assert sick_entry is not None and sick_entry.state is WorkerState.UNHEALTHY
        failures: list[Any] = []
        sent = await send(service, proxy, route, failures)
        assert (sent.worker.url, sent.attempt) == (good.url, 1)  # a skip is no attempt
        assert sick.requests == [] and failures == [(bad.url, 0, "status")]
        await sent.answer.read()


async def test_a_client_error_is_the_answer_and_nothing_is_retried() -> None:
    async with (
        ScriptedWorker("reject") as rejecting,
        ScriptedWorker() as busy,
        routed(rejecting, busy) as (service, proxy),
    ):
        route = await decided(service, rejecting, busy)
        failures: list[Any] = []
        sent = await send(service, proxy, route, failures)
        assert (sent.worker.url, sent.attempt, sent.answer.status) == (rejecting.url, 0, 400)
        assert json.loads(await sent.answer.read())["error"]["code"] == "context_length_exceeded"
        assert failures == [] and busy.requests == []


async def test_only_the_first_attempt_of_a_stream_has_the_learned_deadline() -> None:
    # The stalled worker never sends a chunk, so its 50 ms floor always passes; the fallback
    # waits the proxy's ceiling, so it is never failed by the estimate.
    async with (
        ScriptedWorker("stall") as stalled,
        ScriptedWorker() as busy,
        routed(stalled, busy) as (service, proxy),
    ):
        route = await decided(service, stalled, busy, stream=True)
        failures: list[Any] = []
        sent = await send(service, proxy, route, failures, stream=True, floor=0.05)
        assert (sent.worker.url, sent.attempt, sent.answer.status) == (busy.url, 1, 200)
        assert failures == [(stalled.url, 0, "deadline")]
        body = b"".join([chunk async for chunk in sent.answer.stream()])
        assert body.endswith(b"data: [DONE]\n\n")


async def test_when_every_attempt_failed_to_connect_a_second_round_follows_a_pause() -> None:
    async with (
        ScriptedWorker() as first,
        ScriptedWorker() as second,
        ScriptedWorker() as third,
        routed(first, second, third, proxy=Blip(MAX_ATTEMPTS)) as (service, proxy),
    ):
        route = await decided(service, first, second, third)
        failures: list[Any] = []
        pauses: list[float] = []
        sent = await send(service, proxy, route, failures, pauses=pauses)
        assert pauses == [RETRY_PAUSE_S]
        assert [cause for _, _, cause in failures] == ["connect"] * MAX_ATTEMPTS
        # the second round starts again from the chosen worker, the prefix holder
        assert (sent.worker.url, sent.attempt, sent.answer.status) == (
            first.url, MAX_ATTEMPTS, 200)
        await sent.answer.read()
        assert [active(service, w) for w in (first, second, third)] == [1, 0, 0]


async def test_a_blip_longer_than_both_rounds_is_a_503() -> None:
    async with (
        ScriptedWorker() as first,
        ScriptedWorker() as second,
        routed(first, second, proxy=Blip(100)) as (service, proxy),
    ):
        route = await decided(service, first, second)
        failures: list[Any] = []
        pauses: list[float] = []
        with pytest.raises(ApiError) as refused:
            await send(service, proxy, route, failures, pauses=pauses)
        assert refused.value.status == 503 and "tried 4" in str(refused.value)
        assert pauses == [RETRY_PAUSE_S] and len(failures) == 4
        assert first.requests == second.requests == []
