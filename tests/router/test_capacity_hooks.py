"""The service tells flow control what frees capacity (:class:`router.routing.dispatch_gate.
CapacityListener`): a request's first token and its end, once each, and a worker that leaves;
flow control's dispatcher wakes on these rather than on a clock."""

from __future__ import annotations

import httpx

from router.fleet.worker_table import WorkerInfo
from router.service import RouterService
from router.settings import RouterSettings


class Told:
    def __init__(self) -> None:
        self.heard: list[tuple[str, object]] = []

    def ended(self, key: str) -> None:
        self.heard.append(("ended", key))

    def wake(self) -> None:
        self.heard.append(("wake", None))

    def reported(self, worker: int, running: int, waiting: int) -> None:
        self.heard.append(("reported", (worker, running, waiting)))

    def forget(self, worker: int) -> None:
        self.heard.append(("forget", worker))


async def test_a_first_token_an_end_and_a_worker_leaving_are_told_once_each() -> None:
    async with httpx.AsyncClient() as http:
        service = RouterService(RouterSettings(seed=1), http)
        told = Told()
        service.capacity = told
        entry = service.registry.adopt(WorkerInfo(
            url="http://w0", model="m", block_size=32, tokenizer="bytes-v1",
            instance_id="i0", max_model_len=1 << 16, max_num_seqs=4))
        route = service.decide({"model": "m", "prompt": "x" * 100}, "completions")
        service.dispatched(route, route.worker)
        service.first_token(route)
        service.finished(route)
        service.finished(route)  # idempotent: told once
        assert told.heard == [("wake", None), ("ended", route.request_id)]
        other = service.decide({"model": "m", "prompt": "y" * 100}, "completions")
        service.undispatched(other)  # never booked: nothing freed
        assert told.heard[-1] == ("ended", route.request_id)
        await service.registry.remove(entry.id)
        assert told.heard[-1] == ("forget", entry.id)
