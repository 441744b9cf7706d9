"""The router's HTTP front: OpenAI-compatible endpoints, health, metrics, debug and admin.

One request's path: read the body within its byte limit, check it against the OpenAI schema,
:meth:`RouterService.decide`, book the load, forward through the :class:`~router.http.proxy.Proxy`,
pass the answer back as it arrives. A worker that fails before the first byte is left for the
next-best one (:mod:`router.http.failover`); the answer names the worker and the matched blocks in
``x-kvroute-*`` headers.

A completions prompt whose length alone proves it longer than every worker's model is refused
before it is encoded; a body over ``TOKENIZE_OFF_LOOP_BYTES`` is encoded in a thread, not on the
event loop. ``/workers`` and ``/debug/*`` want the admin token when one is set: the debug
endpoints tell which prefixes are cached where.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from httpapi.auth import check_bearer
from httpapi.body import (
    TOKENIZE_OFF_LOOP_BYTES,
    ClientGone,
    read_body,
    read_json,
    wait_for_disconnect,
)
from httpapi.responses import CLIENT_GONE_STATUS, disconnect_counter, error_response
from openai_request import tokenize_api
from openai_request.bodies import (
    ApiError,
    fewest_prompt_tokens,
    parse_body,
    validate_request,
)
from openai_request.prompts import PromptTokens
from router.fleet.registry import WorkerEntry, WorkerUnreachable
from router.fleet.worker_config import parse_worker
from router.fleet.worker_table import IncompatibleWorker
from router.http.failover import send_with_failover
from router.http.first_byte import FirstByteClock
from router.http.metrics import RouterMetrics
from router.http.proxy import Proxy, ProxyTimeouts, UpstreamAnswer, UpstreamUnavailable
from router.service import Route, RouterService
from router.settings import RouterSettings

__all__ = ["create_app"]

log = logging.getLogger(__name__)

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
#: Bodies of the admin endpoints are a URL or nothing.
ADMIN_BODY_BYTES = 64 * 1024


def create_app(settings: RouterSettings) -> FastAPI:
    """Build the router app; its lifespan starts and stops every background part."""
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        http = httpx.AsyncClient()
        service = RouterService(settings, http)
        proxy = Proxy(ProxyTimeouts(connect=settings.connect_timeout,
                                    first_byte=settings.first_byte_timeout))
        await proxy.start()
        metrics = RouterMetrics(service)
        clock = FirstByteClock(settings.first_byte_floor, settings.first_byte_factor,
                               settings.first_byte_timeout)
        state.update(service=service, proxy=proxy, metrics=metrics,
                     disconnects=disconnect_counter(metrics.registry), first_byte=clock)
        await service.registry.start()
        try:
            yield
        finally:
            await service.registry.stop()
            await proxy.close()
            await http.aclose()

    app = FastAPI(title="kvroute router", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        state["disconnects"].labels("body").inc()
        return Response(status_code=CLIENT_GONE_STATUS)

    def service() -> RouterService:
        return state["service"]  # type: ignore[no-any-return]

    def admin(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), settings.admin_token)

    async def forward(request: Request, kind: str, path: str) -> Response:
        metrics: RouterMetrics = state["metrics"]
        try:
            raw = await read_body(request, settings.max_body_bytes)
            body = parse_body(raw, settings.max_body_bytes)
            route = await _decide(body, kind, len(raw))
        except ApiError as exc:
            metrics.request(path, exc.status)
            raise
        metrics.decided(route)
        # Until the answer starts streaming back, a client that hangs up is only seen on the
        # ASGI receive channel: race the whole exchange against it, so that the upstream
        # request is cancelled with it (streams are then watched by Starlette).
        # One watcher task that cancels this one is cheaper on the hot path than racing two.
        this = asyncio.current_task()
        assert this is not None, "a request handler runs in a task"
        watcher = asyncio.get_running_loop().create_task(wait_for_disconnect(request.receive))
        watcher.add_done_callback(lambda w: w.cancelled() or this.cancel())
        try:
            return await _exchange(request, raw, bool(body.get("stream")), route, path,
                                   metrics)
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled():  # the client left, not a shutdown
                service().load.finished(route.request_id)
                this.uncancel()
                state["disconnects"].labels("answer").inc()
                return Response(status_code=CLIENT_GONE_STATUS)
            raise
        finally:
            watcher.cancel()

    async def _decide(body: dict[str, Any], kind: str, size: int) -> Route:
        request = validate_request(body, kind)  # type: ignore[arg-type]
        fewest = fewest_prompt_tokens(request, service().tokenizer.max_bytes_per_token)
        # Refused here only when longer than every worker's model (a worker of unknown
        # length takes anything); the service routes it to a worker it fits.
        max_len = service().prompt_bound(body)
        if max_len and fewest > max_len:
            raise ApiError(400, f"the prompt has at least {fewest} tokens, more than the "
                           f"model's {max_len}", param="prompt", code="context_length_exceeded")
        prompt: PromptTokens | None = None
        if size > TOKENIZE_OFF_LOOP_BYTES:
            prompt = await asyncio.to_thread(service().tokenize, body, kind)
        return service().decide(body, kind, prompt)

    async def _exchange(request: Request, raw: bytes, stream: bool, route: Route, path: str,
                        metrics: RouterMetrics) -> Response:
        try:
            sent = await send_with_failover(service(), state["proxy"], state["first_byte"],
                                            route, path, raw, request.headers, stream,
                                            metrics.upstream_failure)
        except ApiError as exc:
            metrics.request(path, exc.status)
            raise
        answer, worker = sent.answer, sent.worker
        headers = {**answer.headers, "x-kvroute-worker": worker.url,
                   "x-kvroute-worker-id": str(worker.id),
                   "x-kvroute-matched-blocks": str(route.decision.chosen.matched_blocks
                                                   if worker is route.worker else 0)}
        metrics.request(path, answer.status)
        if stream and answer.status == 200:
            return StreamingResponse(_relay(answer, route, metrics), status_code=200,
                                     headers=headers, media_type="text/event-stream")
        return await _whole(answer, route, headers, metrics)

    async def _whole(answer: UpstreamAnswer, route: Route, headers: dict[str, str],
                     metrics: RouterMetrics) -> Response:
        try:
            content = await answer.read()
        except UpstreamUnavailable as exc:
            raise ApiError(502, str(exc), "upstream_error") from None
        finally:
            service().load.finished(route.request_id)
        found = _CACHED.search(content)
        if found and answer.status == 200:
            metrics.reported_cached(route, int(found.group(1)))
        headers.pop("content-type", None)
        return Response(content, status_code=answer.status, headers=headers,
                        media_type=answer.headers.get("Content-Type", "application/json"))

    async def _relay(answer: UpstreamAnswer, route: Route, metrics: RouterMetrics
                     ) -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in answer.stream():
                if first:
                    service().load.first_token(route.request_id)
                    first = False
                found = _CACHED.search(chunk)
                if found:
                    metrics.reported_cached(route, int(found.group(1)))
                yield chunk
        finally:
            service().load.finished(route.request_id)

    async def completions(request: Request) -> Response:
        return await forward(request, "completions", "/v1/completions")

    async def chat(request: Request) -> Response:
        return await forward(request, "chat", "/v1/chat/completions")

    # The hot path as plain Starlette routes: FastAPI's per-request dependency and response
    # model machinery buys nothing for a body forwarded as bytes.
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])

    @app.post("/debug/route")
    async def debug_route(request: Request) -> dict[str, Any]:
        admin(request)
        raw = await read_body(request, settings.max_body_bytes)
        body = parse_body(raw, settings.max_body_bytes)
        kind = "chat" if "messages" in body else "completions"
        route = await _decide(body, kind, len(raw))
        return {
            "chosen": route.worker.url, "chosen_id": route.decision.worker,
            "prompt_tokens": len(route.prompt.token_ids), "request_blocks": len(route.hashes),
            "decision_us": round(route.decision_seconds * 1e6, 1),
            "overlap_weight": route.decision.overlap_weight,
            "queue_weight": service().scheduler.queue_weight,
            "continues_session_on": route.continued.worker if route.continued else None,
            "workers": [{"id": c.worker, "url": route.entries[c.worker].url,
                         "matched_blocks": c.matched_blocks,
                         "device_matched_blocks": c.device_matched_blocks,
                         "prefill_blocks": c.prefill_blocks, "decode_blocks": c.decode_blocks,
                         "active_requests": c.active_requests,
                         "sessions": c.sessions,
                         "cost": c.cost}
                        for c in route.decision.costs],
        }

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's ``/tokenize``, with the router's tokenizer: the ids it routes on."""
        raw = await read_body(request, settings.max_body_bytes)
        body = parse_body(raw, settings.max_body_bytes)
        lengths = [e.info.max_model_len for e in service().registry.entries() if e.info]
        max_len = min((n for n in lengths if n), default=0)
        try:
            if len(raw) > TOKENIZE_OFF_LOOP_BYTES:
                return await asyncio.to_thread(tokenize_api.tokenize, body,
                                               service().tokenizer, max_len)
            return tokenize_api.tokenize(body, service().tokenizer, max_len)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    @app.get("/debug/index/{worker_id}")
    async def debug_index(worker_id: int, request: Request) -> dict[str, Any]:
        admin(request)
        if service().registry.get(worker_id) is None:
            raise ApiError(404, f"no worker {worker_id}", code="not_found")
        held = service().index.engine_hashes(worker_id)
        return {"worker": worker_id, "blocks": {str(h): tiers for h, tiers in held.items()}}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": now,
                                            "owned_by": "kvroute"} for m in service().models()]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        healthy = len(service().registry.candidates())
        if healthy == 0:
            return JSONResponse({"ready": False, "reason": "no healthy worker"}, 503)
        return JSONResponse({"ready": True, "workers": healthy})

    @app.get("/metrics")
    async def metrics_page() -> Response:
        body, content_type = state["metrics"].render()
        return Response(body, media_type=content_type)

    @app.get("/workers")
    async def list_workers(request: Request) -> dict[str, Any]:
        admin(request)
        reg = service().registry
        index = service().index
        workers = []
        for e in reg.entries():
            device, host = index.worker_blocks(e.id)
            workers.append({**e.describe(), "blocks": {"device": device, "host": host}})
        return {"workers": workers, "index": {"blocks": index.num_blocks()}}

    @app.post("/workers", status_code=201)
    async def add_worker(request: Request) -> dict[str, Any]:
        admin(request)
        body = await read_json(request, ADMIN_BODY_BYTES)
        url = body.get("url")
        if type(url) is not str:
            raise ApiError(400, "give the worker as {\"url\": \"http://host:port\"}", param="url")
        try:  # the other keys of router.fleet.worker_config: engine, events, replay, block_size
            entry = await service().registry.add(parse_worker(body))
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
        try:
            entry: WorkerEntry = await service().registry.remove(worker_id)
        except KeyError:
            raise ApiError(404, f"no worker {worker_id}", code="not_found") from None
        state["first_byte"].forget(worker_id)
        return entry.describe()

    return app
