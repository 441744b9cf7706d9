"""The worker's control surface, for the router and for operators: ``GET /model_info`` and
``GET /load`` (open: the router's control calls), ``POST /kv_transfer/release`` (open: a
decode worker saying it took a prefill's KV, :mod:`workers.http.kv_transfer`),
``GET /kv_transfer/blocks/{remote_request_id}`` (open: the torch engine's held KV, for the
decode worker that pulls it, :mod:`workers.http.kv_pull`), and, behind
the admin token when one is set, ``POST /reset_prefix_cache``, ``GET /kv/snapshot`` (every
resident block, as one encoded event batch, for a router that lost the stream) and
``POST /debug/drop_events`` (fault injection: withhold the next N event batches from the live
socket, as a PUB socket at its high-water mark would).
"""

from __future__ import annotations

import base64
from typing import Any

from fastapi import FastAPI, Request, Response

from httpapi.app import ADMIN_BODY_BYTES
from httpapi.body import read_json
from indexer.wire import encode_batch
from openai_request.bodies import ApiError
from workers.http.kv_pull import serve_blocks
from workers.http.state import WorkerState

__all__ = ["add_control_routes"]


def add_control_routes(app: FastAPI, state: WorkerState) -> None:
    """Add the module docstring's endpoints to ``app``, serving from ``state``."""
    runtime, admin = state.runtime, state.admin

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return runtime.model_info()

    @app.get("/load")
    async def load() -> dict[str, Any]:
        state.held_prefills.expire()  # polled by routers: leases end even with no traffic
        return runtime.load()

    @app.post("/kv_transfer/release")
    async def release(request: Request) -> dict[str, Any]:
        body = await read_json(request, ADMIN_BODY_BYTES)
        lease = body.get("remote_request_id")
        if not isinstance(lease, str):
            raise ApiError(400, "the body must be {\"remote_request_id\": \"...\"}",
                           param="remote_request_id")
        return {"released": state.held_prefills.release(lease)}

    @app.get("/kv_transfer/blocks/{lease_id}")
    async def blocks(lease_id: str) -> Response:
        return await serve_blocks(state.held_prefills, lease_id)

    @app.post("/reset_prefix_cache")
    async def reset(request: Request) -> dict[str, Any]:
        admin(request)
        if not await runtime.reset_prefix_cache():
            raise ApiError(409, "requests are running; reset when the worker is idle",
                           code="busy")
        return {"reset": True}

    @app.get("/kv/snapshot")
    async def snapshot(request: Request) -> dict[str, Any]:
        admin(request)
        seq, batch = runtime.engine.snapshot()
        return {"seq": seq, "data_parallel_rank": state.settings.data_parallel_rank,
                "blocks": sum(len(e.block_hashes) for e in batch.events),
                "payload_b64": base64.b64encode(encode_batch(batch)).decode()}

    @app.post("/debug/drop_events")
    async def drop_events(request: Request) -> dict[str, Any]:
        admin(request)
        body = await read_json(request, ADMIN_BODY_BYTES)
        batches = body.get("batches")
        if type(batches) is not int or batches < 0:
            raise ApiError(400, "give {\"batches\": N} with N >= 0", param="batches")
        runtime.engine.drop_next_batches(batches)
        return {"dropping": batches}
