"""A late health probe from a busy worker is not death: the registry weighs it with the data
path's evidence (:mod:`router.fleet.liveness`).

The scenarios run the registry and the proxy as the router wires them, against a scripted
worker whose ``/load`` hangs (every probe is late) and whose stream sends a chunk when the test
says; the polls are driven one at a time with ``poll_once``, and the worker's liveness reads a
clock that moves only when the test moves it. The scenarios that count misses across answered
probes are driven by the worker's state alone (``late_at_once``): a probe of a hung ``/load``
times out at once and an answered one has a generous timeout, so a connect slowed by a loaded
machine cannot turn an answer into a miss.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from router.fleet.liveness import Liveness
from router.fleet.worker_table import WorkerState
from router.http.failover import send_with_failover
from router.http.first_byte import FirstByteClock
from router.http.proxy import Proxy, ProxyTimeouts
from router.service import RouterService
from router.settings import RouterSettings
from tests.support.servers import ScriptedWorker

BODY = {"model": "kvroute-sim", "prompt": "hello liveness " * 8, "max_tokens": 4,
        "stream": True}


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


class HungLoadTimesOut(httpx.AsyncBaseTransport):
    """The probes' transport when a test drives lateness by state: a ``/load`` probe of a
    worker whose ``/load`` hangs (:meth:`ScriptedWorker.hang_load`) times out at once, as the
    client's read timeout would; every other request goes to the worker."""

    def __init__(self, workers: tuple[ScriptedWorker, ...]) -> None:
        self._workers = {w.port: w for w in workers}
        self._real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        worker = self._workers.get(request.url.port or 0)
        if worker is not None and worker.load_hangs and request.url.path == "/load":
            raise httpx.ReadTimeout("no answer (the worker's /load hangs)", request=request)
        return await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        await self._real.aclose()


@contextlib.asynccontextmanager
async def routed(*workers: ScriptedWorker, health_timeout: float = 0.2,
                 late_at_once: bool = False, **kw: Any
                 ) -> AsyncIterator[tuple[RouterService, Proxy, Clock]]:
    """The router's service and proxy in front of ``workers``, and the clock of every worker's
    liveness. The background poll waits an hour between rounds, so only the test's
    ``poll_once`` calls probe; a probe gives up after ``health_timeout`` (the evidence window
    too). ``late_at_once``: a probe of a hung ``/load`` times out at once
    (:class:`HungLoadTimesOut`), so lateness follows the worker's state alone."""
    settings = RouterSettings(workers=tuple(w.url for w in workers), health_interval=3600,
                              health_timeout=health_timeout, seed=3, **kw)
    clock = Clock()
    transport = HungLoadTimesOut(workers) if late_at_once else None
    async with httpx.AsyncClient(transport=transport) as http:
        service = RouterService(settings, http)
        proxy = Proxy(ProxyTimeouts(connect=2.0, first_byte=30.0))
        await proxy.start()
        await service.registry.start()
        for entry in service.registry.entries():
            entry.liveness.clock = clock
        try:
            yield service, proxy, clock
        finally:
            await service.registry.stop()
            await proxy.close()


async def test_late_probes_while_the_worker_streams_keep_it_and_its_stream() -> None:
    async with ScriptedWorker("paced") as worker, routed(worker) as (service, proxy, clock):
        [entry] = service.registry.entries()
        assert entry.state is WorkerState.HEALTHY
        route = service.decide(BODY, "completions", None)
        worker.release()  # the stream's first chunk: the send returns with it
        sent = await send_with_failover(service, proxy, FirstByteClock(2.0, 4.0, 30.0), route,
                                        "/v1/completions", json.dumps(BODY).encode(), {}, True,
                                        lambda *_: None)
        chunks = sent.answer.stream()
        received = [await anext(chunks)]
        worker.hang_load()
        for _ in range(5):  # more late probes than health_misses, each just after a chunk
            clock.now += 1.0
            worker.release()
            received.append(await anext(chunks))
            clock.now += 0.1  # the probe is judged 0.1 s after the chunk came
            await service.registry.poll_once()
            assert entry.state is WorkerState.HEALTHY, entry.last_error
        assert service.registry.candidates() == [entry]
        worker.finish()
        received += [chunk async for chunk in chunks]
        worker.resume()
    assert entry.counters["late_probes_excused"] == 5
    assert "late_probes" not in entry.counters and "health_failures" not in entry.counters
    text = b"".join(received)
    assert text.count(b'"text":"x"') == 6 and text.endswith(b"data: [DONE]\n\n")
    assert b"error" not in text


async def test_bytes_older_than_the_probe_excuse_nothing() -> None:
    async with ScriptedWorker() as worker, routed(worker) as (service, _, clock):
        [entry] = service.registry.entries()
        entry.liveness.progressed()  # the last byte of a stream
        clock.now += 0.3  # and then nothing for longer than a probe waits
        worker.hang_load()
        await service.registry.poll_once()
        assert entry.state is WorkerState.HEALTHY and entry.counters["late_probes"] == 1
        await service.registry.poll_once()
        assert entry.state is WorkerState.UNHEALTHY
        worker.resume()


async def test_late_probes_with_no_bytes_from_the_worker_take_it_out_at_health_misses() -> None:
    async with ScriptedWorker() as worker, routed(worker, health_timeout=30.0, late_at_once=True,
                                                  health_misses=3) as (service, _, _):
        [entry] = service.registry.entries()
        worker.hang_load()
        await service.registry.poll_once()
        await service.registry.poll_once()
        assert entry.state is WorkerState.HEALTHY
        assert entry.counters["late_probes"] == 2
        await service.registry.poll_once()
        assert entry.state is WorkerState.UNHEALTHY
        assert entry.last_error is not None
        assert "no answer within 30.0s (3 polls in a row" in entry.last_error
        worker.resume()
        await service.registry.poll_once()
        assert entry.state is WorkerState.HEALTHY


async def test_an_answered_probe_starts_the_count_of_misses_again() -> None:
    async with ScriptedWorker() as worker, routed(worker, health_timeout=30.0,
                                                  late_at_once=True) as (service, _, _):
        [entry] = service.registry.entries()
        for _ in range(3):
            worker.hang_load()
            await service.registry.poll_once()
            worker.resume()
            await service.registry.poll_once()
        assert entry.state is WorkerState.HEALTHY
        assert entry.counters["late_probes"] == 3
        assert "health_failures" not in entry.counters


async def test_a_refused_probe_takes_it_out_at_once_whatever_its_streams_showed() -> None:
    async with routed() as (service, _, _):
        async with ScriptedWorker() as worker:
            entry = await service.registry.add(worker.url)
        entry.liveness.progressed()
        await service.registry.poll_once()  # the worker's port is closed: refused
        assert entry.state is WorkerState.UNHEALTHY
        assert entry.last_error is not None and "ConnectError" in entry.last_error


def test_a_byte_on_the_data_path_excuses_a_late_probe_only_within_the_window() -> None:
    clock = Clock()
    liveness = Liveness(misses=2, window=3.0, clock=clock)
    assert liveness.late() == "missed"  # no byte ever
    liveness.progressed()
    clock.now += 3.0
    assert liveness.late() == "excused"  # 3 s old: within the window; misses start again
    assert liveness.misses == 0
    clock.now += 0.5
    assert liveness.late() == "missed"  # 3.5 s old: stale
    assert liveness.late() == "gone"


def test_an_answered_probe_clears_the_misses() -> None:
    liveness = Liveness(misses=2, window=1.0, clock=Clock())
    assert liveness.late() == "missed"
    liveness.answered()
    assert liveness.late() == "missed"
    assert liveness.late() == "gone"
