"""The router's OpenAI surface: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` and vLLM's ``POST /tokenize`` with the router's tokenizer.

One request's path: read the body within its byte limit, check it against the OpenAI schema,
:meth:`RouterService.decide`, book the load, forward through the :class:`~router.http.proxy.Proxy`,
pass the answer back as it arrives. A worker that fails before the first byte is left for the
next-best one (:mod:`router.http.failover`); the answer names the worker and the matched blocks in
``x-kvroute-*`` headers.

A completions prompt whose length alone proves it longer than every worker's model is refused
before it is encoded; a body over ``TOKENIZE_OFF_LOOP_BYTES`` is encoded in a thread, not on the
event loop.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from httpapi.body import TOKENIZE_OFF_LOOP_BYTES, read_body, wait_for_disconnect
from httpapi.responses import CLIENT_GONE_STATUS
from openai_request import tokenize_api
from openai_request.bodies import ApiError, fewest_prompt_tokens, parse_body, validate_request
from openai_request.prompts import PromptTokens
from router.http.failover import send_with_failover
from router.http.proxy import UpstreamAnswer, UpstreamUnavailable
from router.http.state import RouterState
from router.service import Route

__all__ = ["add_openai_routes", "decide"]

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def add_openai_routes(app: FastAPI, state: RouterState) -> None:
    """Add the module docstring's endpoints to ``app``, serving from ``state``."""

    async def completions(request: Request) -> Response:
        return await forward(state, request, "completions", "/v1/completions")

    async def chat(request: Request) -> Response:
        return await forward(state, request, "chat", "/v1/chat/completions")

    # The hot path as plain Starlette routes: FastAPI's per-request dependency and response
    # model machinery buys nothing for a body forwarded as bytes.
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's ``/tokenize``, with the router's tokenizer: the ids it routes on."""
        raw = await read_body(request, state.settings.max_body_bytes)
        body = parse_body(raw, state.settings.max_body_bytes)
        service = state.service
        lengths = [e.info.max_model_len for e in service.registry.entries() if e.info]
        max_len = min((n for n in lengths if n), default=0)
        try:
            if len(raw) > TOKENIZE_OFF_LOOP_BYTES:
                return await asyncio.to_thread(tokenize_api.tokenize, body,
                                               service.tokenizer, max_len)
            return tokenize_api.tokenize(body, service.tokenizer, max_len)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": now,
                                            "owned_by": "kvroute"}
                                           for m in state.service.models()]}


async def decide(state: RouterState, body: dict[str, Any], kind: str, size: int) -> Route:
    """Check ``body`` (``size`` bytes long) as a ``kind`` request and route it.

    Raises:
        ApiError: 400 for a body that is not a valid request, or a prompt provably longer
            than every worker's model; the service's refusals (no worker, unknown model).
    """
    service = state.service
    request = validate_request(body, kind)  # type: ignore[arg-type]
    fewest = fewest_prompt_tokens(request, service.tokenizer.max_bytes_per_token)
    # Refused here only when longer than every worker's model (a worker of unknown
    # length takes anything); the service routes it to a worker it fits.
    max_len = service.prompt_bound(body)
    if max_len and fewest > max_len:
        raise ApiError(400, f"the prompt has at least {fewest} tokens, more than the "
                       f"model's {max_len}", param="prompt", code="context_length_exceeded")
    prompt: PromptTokens | None = None
    if size > TOKENIZE_OFF_LOOP_BYTES:
        prompt = await asyncio.to_thread(service.tokenize, body, kind)
    return service.decide(body, kind, prompt)


async def forward(state: RouterState, request: Request, kind: str, path: str) -> Response:
    """Route and forward one ``kind`` request, answered at ``path`` (module docstring)."""
    metrics = state.metrics
    max_bytes = state.settings.max_body_bytes
    try:
        raw = await read_body(request, max_bytes)
        body = parse_body(raw, max_bytes)
        route = await decide(state, body, kind, len(raw))
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
        return await _exchange(state, request, raw, bool(body.get("stream")), route, path)
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():  # the client left, not a shutdown
            state.service.load.finished(route.request_id)
            this.uncancel()
            state.client_gone("answer")
            return Response(status_code=CLIENT_GONE_STATUS)
        raise
    finally:
        watcher.cancel()


async def _exchange(state: RouterState, request: Request, raw: bytes, stream: bool,
                    route: Route, path: str) -> Response:
    metrics = state.metrics
    try:
        sent = await send_with_failover(state.service, state.proxy, state.first_byte, route,
                                        path, raw, request.headers, stream,
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
        return StreamingResponse(_relay(state, answer, route), status_code=200,
                                 headers=headers, media_type="text/event-stream")
    return await _whole(state, answer, route, headers)


async def _whole(state: RouterState, answer: UpstreamAnswer, route: Route,
                 headers: dict[str, str]) -> Response:
    try:
        content = await answer.read()
    except UpstreamUnavailable as exc:
        raise ApiError(502, str(exc), "upstream_error") from None
    finally:
        state.service.load.finished(route.request_id)
    found = _CACHED.search(content)
    if found and answer.status == 200:
        state.metrics.reported_cached(route, int(found.group(1)))
    headers.pop("content-type", None)
    return Response(content, status_code=answer.status, headers=headers,
                    media_type=answer.headers.get("Content-Type", "application/json"))


async def _relay(state: RouterState, answer: UpstreamAnswer, route: Route
                 ) -> AsyncIterator[bytes]:
    load = state.service.load
    first = True
    try:
        async for chunk in answer.stream():
            if first:
                load.first_token(route.request_id)
                first = False
            found = _CACHED.search(chunk)
            if found:
                state.metrics.reported_cached(route, int(found.group(1)))
            yield chunk
    finally:
        load.finished(route.request_id)
