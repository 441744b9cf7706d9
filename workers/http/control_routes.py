"""The worker's control surface, for the router and for operators: ``GET /model_info`` and
``GET /load`` (open: the router's control calls); the KV transfer endpoints, each behind
:mod:`workers.http.transfer_auth` (the shared secret, or loopback only):
``POST /kv_transfer/release`` (a decode worker saying it took a prefill's KV,
:mod:`workers.http.kv_transfer`), ``GET /kv_transfer/blocks/{remote_request_id}`` (the torch
engine's held KV, for the decode worker that pulls it, :mod:`workers.http.kv_pull`) and
``POST /kv_transfer/read`` (blocks by engine key, for a peer told to fetch them,
:mod:`workers.http.kv_read`), ``POST /kv_transfer/ipc/open`` and
``POST /kv_transfer/read/release`` (the same over CUDA IPC, :mod:`workers.http.kv_ipc`); and,
behind
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
from indexer.wire import BlockStored, encode_batch
from openai_request.bodies import ApiError
from workers.http.kv_fetch import http_bandwidth
from workers.http.kv_ipc import OPEN_PATH, RELEASE_PATH, TRANSFER
from workers.http.kv_pull import engine_kv, serve_blocks
from workers.http.kv_read import READ_BODY_BYTES, parse_keys, parse_transfer
from workers.http.state import WorkerState

__all__ = ["add_control_routes"]


def add_control_routes(app: FastAPI, state: WorkerState) -> None:
    """Add the module docstring's endpoints to ``app``, serving from ``state``."""
    runtime, admin = state.runtime, state.admin

    auth = state.transfer_auth
    kv = engine_kv(runtime.engine)
    kv_fetch: dict[str, Any] = {
        "serve": auth.enabled, "receive": auth.enabled,
        "kv_bytes_per_token": (state.settings.kv_bytes_per_token if kv is None
                               else kv.layout().block_bytes // kv.layout().block_size),
        "transfer": "http", "http_bandwidth": http_bandwidth(state.settings, kv is not None)}
    ipc = state.block_reads.ipc

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        identity = None if ipc is None else ipc.identity
        if identity is None or not auth.enabled:
            return {**runtime.model_info(), "kv_fetch": kv_fetch}
        return {**runtime.model_info(), "kv_fetch": {
            **kv_fetch, "transfers": ["http", TRANSFER], TRANSFER: identity.as_json()}}

    @app.get("/load")
    async def load() -> dict[str, Any]:
        state.held_prefills.expire()  # polled by routers: leases and pins end with no traffic
        state.block_reads.expire()
        return runtime.load()

    @app.post("/kv_transfer/read")
    async def read(request: Request) -> Response:
        try:
            auth.check_peer(request)
            body = await read_json(request, READ_BODY_BYTES)
            keys, transfer = parse_keys(body), parse_transfer(body)
            answer, blocks = await state.block_reads.answer(keys, transfer)
        except ApiError:
            state.metrics.kv_reads.labels("refused").inc()
            raise
        state.metrics.kv_reads.labels("served" if blocks else "missing").inc()
        return answer

    @app.post(OPEN_PATH)
    async def ipc_open(request: Request) -> dict[str, Any]:
        auth.check_peer(request)
        body = await read_json(request, ADMIN_BODY_BYTES)
        if ipc is None:
            raise ApiError(409, "this worker's KV is not on a CUDA device; read it over HTTP",
                           code="no_cuda_ipc")
        return ipc.open_answer(body)

    @app.post(RELEASE_PATH)
    async def read_release(request: Request) -> dict[str, Any]:
        auth.check_peer(request)
        body = await read_json(request, ADMIN_BODY_BYTES)
        pin = body.get("pin")
        if not isinstance(pin, str):
            raise ApiError(400, "the body must be {\"pin\": \"...\"}", param="pin")
        return {"released": state.block_reads.finish(pin)}

    @app.post("/kv_transfer/release")
    async def release(request: Request) -> dict[str, Any]:
        auth.check_peer(request)
        body = await read_json(request, ADMIN_BODY_BYTES)
        lease = body.get("remote_request_id")
        if not isinstance(lease, str):
            raise ApiError(400, "the body must be {\"remote_request_id\": \"...\"}",
                           param="remote_request_id")
        return {"released": state.held_prefills.release(lease)}

    @app.get("/kv_transfer/blocks/{lease_id}")
    async def blocks(request: Request, lease_id: str) -> Response:
        auth.check_peer(request)
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
                "blocks": sum(len(e.block_hashes) for e in batch.events
                              if isinstance(e, BlockStored)),
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
