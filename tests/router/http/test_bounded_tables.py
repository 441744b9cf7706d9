"""The router's tables stay bounded however many requests pass: predictions expire as requests
flow, a refused request books nothing, the load books hold only what is in flight, and the
session heads stop at their bound."""

from __future__ import annotations

import re

import httpx

from router.fleet.worker_table import WorkerInfo
from router.routing.sessions import SessionTracker
from router.service import RouterService
from router.settings import RouterSettings
from tests.router.test_router_service import BODY, router_for
from tests.support.servers import ScriptedWorker


def service_with_workers(http: httpx.AsyncClient, workers: int = 3, **settings: object
                         ) -> RouterService:
    service = RouterService(RouterSettings(seed=1, **settings), http)  # type: ignore[arg-type]
    for w in range(workers):
        service.registry.adopt(WorkerInfo(url=f"http://w{w}", model="m", block_size=32,
                                          tokenizer="bytes-v1", instance_id=f"i{w}",
                                          max_model_len=1 << 16))
    return service


async def test_many_requests_leave_bounded_tables() -> None:
    # A ttl of a microsecond: every request's predictions have expired by the next one, so
    # what stays is at most the last request's blocks. Without expiry the 3,000 requests'
    # 8 blocks each would all stay (24,000). The adopted workers publish no events, so their
    # predictions are the approximate-mode table's.
    async with httpx.AsyncClient() as http:
        service = service_with_workers(http, predict_ttl=1e-6, approximate_ttl=1e-6)
        sessions = service.core._sessions = SessionTracker(max_heads=256)
        last = None
        for i in range(3000):
            body = {"model": "m", "prompt": f"{i:06d} a distinct prompt " * 11}
            route = service.decide(body, "completions")
            service.dispatched(route, route.worker)
            service.first_token(route)
            service.finished(route)
            last = route
        assert last is not None and len(last.hashes) == 8
        held = [service.core.predicted_blocks(w) for w in range(3)]
        assert sum(held) <= len(last.hashes), held
        assert [service.core.in_flight(w) for w in range(3)] == [0, 0, 0]
        assert [service.core.pending_prefill(w) for w in range(3)] == [0, 0, 0]
        assert len(sessions) <= 256


async def test_a_request_the_worker_refused_books_no_predicted_blocks() -> None:
    async with ScriptedWorker("reject") as worker, router_for(worker, ready=1) as client:
        for i in range(20):
            r = await client.post("/v1/completions",
                                  json={**BODY, "prompt": f"{i} refused " * 40})
            assert r.status_code == 400
        metrics = (await client.get("/metrics")).text
    found = re.search(r'^kvroute_predicted_blocks\{worker="[^"]+"\} (\S+)$', metrics, re.M)
    assert found is not None and float(found.group(1)) == 0.0
