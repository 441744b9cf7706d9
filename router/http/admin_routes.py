"""The router's fleet surface: ``GET /ready`` (open: whether any worker is healthy) and, behind
the admin token when one is set, ``GET``/``POST /workers``, ``DELETE /workers/{id}`` and
``GET /debug/index/{id}`` (which blocks the index holds for a worker: it tells which prefixes
are cached where).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from httpapi.app import ADMIN_BODY_BYTES
from httpapi.body import read_json
from openai_request.bodies import ApiError
from router.fleet.entry import WorkerEntry
from router.fleet.registry import WorkerUnreachable
from router.fleet.worker_config import parse_worker
from router.fleet.worker_table import IncompatibleWorker
from router.http.state import RouterState

__all__ = ["add_admin_routes"]


def add_admin_routes(app: FastAPI, state: RouterState) -> None:
    """Add the module docstring's endpoints to ``app``, serving from ``state``."""
    admin = state.admin

    @app.get("/ready")
    async def ready() -> JSONResponse:
        healthy = len(state.service.healthy())
        if healthy == 0:
            reason = state.service.unavailable()
            return JSONResponse({"ready": False, "reason": f"no healthy worker: {reason}"}, 503)
        answer: dict[str, Any] = {"ready": True, "workers": healthy}
        candidates = len(state.service.candidates())
        if candidates != healthy:  # data-parallel ranks: each one a candidate
            answer["candidates"] = candidates
        return JSONResponse(answer)

    @app.get("/workers")
    async def list_workers(request: Request) -> dict[str, Any]:
        admin(request)
        index = state.service.index
        workers = []
        for e in state.service.workers():
            described = e.describe()
            for rank in described["ranks"]:  # each data-parallel rank's cache of its own
                rank_device, rank_host = index.worker_blocks(rank["id"])
                rank["blocks"] = {"device": rank_device, "host": rank_host}
            # The worker's blocks are all its ranks' together.
            device = sum(index.worker_blocks(t.id)[0] for t in e.targets)
            host = sum(index.worker_blocks(t.id)[1] for t in e.targets)
            workers.append({**described, "blocks": {"device": device, "host": host}})
        return {"workers": workers, "index": {"blocks": index.num_blocks()}}

    @app.post("/workers", status_code=201)
    async def add_worker(request: Request) -> dict[str, Any]:
        admin(request)
        body = await read_json(request, ADMIN_BODY_BYTES)
        url = body.get("url")
        if type(url) is not str:
            raise ApiError(400, "give the worker as {\"url\": \"http://host:port\"}", param="url")
        try:  # the other keys of router.fleet.worker_config: engine, events, replay, block_size
            entry = await state.service.registry.add(parse_worker(body))
        except IncompatibleWorker as exc:
            raise ApiError(409, str(exc), "incompatible_worker") from None
        except WorkerUnreachable as exc:
            raise ApiError(502, str(exc), "upstream_error") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), param="url") from None
        return entry.describe()

    @app.delete("/workers/{worker_id}")
    async def remove_worker(worker_id: int, request: Request) -> dict[str, Any]:
        admin(request)
        known = state.service.registry.get(worker_id)
        ranks = [t.id for t in known.targets] if known is not None else []
        try:
            entry: WorkerEntry = await state.service.registry.remove(worker_id)
        except KeyError:
            raise ApiError(404, f"no worker {worker_id}", code="not_found") from None
        for candidate in ranks:
            state.first_byte.forget(candidate)
        return entry.describe()

    @app.get("/debug/index/{worker_id}")
    async def debug_index(worker_id: int, request: Request) -> dict[str, Any]:
        admin(request)
        if state.service.registry.target(worker_id) is None:  # a worker or one of its ranks
            raise ApiError(404, f"no worker {worker_id}", code="not_found")
        held = state.service.index.engine_hashes(worker_id)
        return {"worker": worker_id, "blocks": {str(h): tiers for h, tiers in held.items()}}
