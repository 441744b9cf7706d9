"""The worker's OpenAI-compatible HTTP API, in front of one engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``GET /model_info``, ``GET /load``, and,
behind the admin token when one is set, ``POST /reset_prefix_cache``, ``GET /kv/snapshot``
and ``POST /debug/drop_events`` (fault injection: withhold the next N event batches from the
live socket, as a PUB socket at its high-water mark would).

Every malformed request gets an OpenAI-style JSON error with a 4xx status and the reason, and
is refused before the engine sees it: nothing half-applied stays in the cache. A body is read
within its byte limit and checked against the OpenAI schema
(:func:`openai_request.bodies.validate_request`) first; a completions prompt whose length alone
proves it too long for the model is refused before it is encoded, and a large body is encoded
in a thread rather than on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from httpapi.auth import check_bearer
from httpapi.body import (
    TOKENIZE_OFF_LOOP_BYTES,
    ClientGone,
    read_body,
    read_json,
    wait_for_disconnect,
)
from httpapi.responses import CLIENT_GONE_STATUS, disconnect_counter, error_response
from indexer.wire import encode_batch
from openai_request.bodies import (
    ApiError,
    error_body,
    fewest_prompt_tokens,
    parse_body,
    validate_request,
)
from openai_request.prompts import build_prompt
from workers.cache.block_keys import Prompt, Scope
from workers.engine.loop import RequestFailed
from workers.http.image_fetch import fetch_remote_images
from workers.http.metrics import WorkerMetrics
from workers.http.openai_format import Completion, sse
from workers.http.vllm_compat import register_vllm_compat
from workers.runtime import WorkerRuntime
from workers.settings import WorkerSettings

__all__ = ["create_app"]

DEFAULT_MAX_TOKENS = 16


#: Bodies of the admin endpoints are a number or nothing.
ADMIN_BODY_BYTES = 64 * 1024


def create_app(settings: WorkerSettings) -> FastAPI:
    """Build the worker app; its lifespan starts the engine and the event publisher."""
    runtime = WorkerRuntime(settings)
    metrics = WorkerMetrics(runtime)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(title="kvroute worker", lifespan=lifespan)
    app.state.runtime = runtime
    register_vllm_compat(app, runtime)  # /tokenize, render, /server_info: for peer routers

    disconnects = disconnect_counter(metrics.registry)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        metrics.refused.labels(str(exc.status)).inc()
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        disconnects.labels("body").inc()
        return Response(status_code=CLIENT_GONE_STATUS)

    def admin(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), settings.admin_token)

    async def generate(request: Request, chat: bool) -> Response:
        raw = await read_body(request, settings.max_body_bytes)
        body = parse_body(raw, settings.max_body_bytes)
        checked = validate_request(body, "chat" if chat else "completions")
        if checked.n not in (None, 1):
            raise ApiError(400, f"only n=1 is supported, got {checked.n}", param="n")
        model = settings.model if checked.model is None else checked.model
        lora = runtime.lora_scope(model)
        if model != settings.model and lora is None:
            raise ApiError(404, f"the model {model!r} does not exist", param="model",
                           code="model_not_found")
        if chat and not settings.images and _has_images(body):
            raise ApiError(400, "this worker does not take images", param="messages")
        max_tokens = checked.output_limit or DEFAULT_MAX_TOKENS
        _check_length(fewest_prompt_tokens(checked, runtime.tokenizer.max_bytes_per_token),
                      max_tokens, settings.max_model_len, at_least=True)
        fetched = await fetch_remote_images(body, settings) if chat else {}
        encode = functools.partial(
            build_prompt, body, "chat" if chat else "completions", runtime.tokenizer,
            mm_tokens_per_image=settings.mm_tokens_per_image,
            max_image_bytes=settings.max_image_bytes, fetch=fetched.get)
        try:
            tokens = (await asyncio.to_thread(encode) if len(raw) > TOKENIZE_OFF_LOOP_BYTES
                      else encode())
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if any(span.digest is None for span in tokens.images):
            raise ApiError(400, "an image could not be fetched or decoded", param="messages")
        _check_length(len(tokens.token_ids), max_tokens, settings.max_model_len)
        scope = Scope(lora_id=lora[0] if lora else None, lora_name=lora[1] if lora else None,
                      salt=runtime.scope_salt(tokens.cache_salt))
        try:
            prompt = Prompt(tokens.token_ids, tuple(tokens.images), scope)
            handle = runtime.submit(f"req-{uuid.uuid4().hex}", prompt, max_tokens)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        reply = Completion(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model, chat,
                           int(time.time()), len(tokens.token_ids))
        metrics.requests.labels("chat" if chat else "completions").inc()
        if checked.stream:
            return StreamingResponse(_stream(handle, reply, checked.include_usage),
                                     media_type="text/event-stream")
        return await _whole(request, handle, reply)

    async def _whole(request: Request, handle: Any, reply: Completion) -> JSONResponse:
        collect = asyncio.ensure_future(_collect(handle))
        gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
        try:
            await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not collect.done():
            collect.cancel()
            handle.cancel()
            disconnects.labels("answer").inc()
            return JSONResponse({"error": "client went away"}, status_code=CLIENT_GONE_STATUS)
        try:
            ids, reason = collect.result()
        except RequestFailed as exc:
            raise ApiError(500, f"the engine failed the request: {exc}", "server_error"
                           ) from None
        reply.cached_tokens = handle.num_cached_tokens or 0
        metrics.finished(reply, len(ids))
        return JSONResponse(reply.whole(runtime.tokenizer.decode(ids), reason, len(ids)))

    async def _stream(handle: Any, reply: Completion, usage: bool) -> AsyncIterator[bytes]:
        count, first = 0, True
        try:
            try:
                async for out in handle:
                    count += 1
                    text = runtime.tokenizer.decode([out.token_id])
                    yield reply.chunk(text, out.finish_reason if out.finished else None,
                                      first=first)
                    first = False
            except RequestFailed as exc:
                yield sse(error_body(ApiError(500, f"the engine failed the request: {exc}",
                                              "server_error")))
                yield sse("[DONE]")
                return
            reply.cached_tokens = handle.num_cached_tokens or 0
            metrics.finished(reply, count)
            if usage:
                yield reply.usage_chunk(count)
            yield sse("[DONE]")
        finally:
            handle.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = [settings.model, *settings.loras]
        return {"object": "list", "data": [{"id": m, "object": "model",
                                            "created": runtime.started_at, "owned_by": "kvroute"}
                                           for m in names]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return runtime.model_info()

    @app.get("/load")
    async def load() -> dict[str, Any]:
        return runtime.engine.load()

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset(request: Request) -> dict[str, Any]:
        admin(request)
        if not await runtime.engine.reset_prefix_cache():
            raise ApiError(409, "requests are running; reset when the worker is idle",
                           code="busy")
        return {"reset": True}

    @app.get("/kv/snapshot")
    async def snapshot(request: Request) -> dict[str, Any]:
        admin(request)
        seq, batch = runtime.engine.snapshot()
        return {"seq": seq, "data_parallel_rank": settings.data_parallel_rank,
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

    return app


def _check_length(prompt_tokens: int, max_tokens: int, max_model_len: int,
                  at_least: bool = False) -> None:
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"the prompt ({'at least ' if at_least else ''}{prompt_tokens} "
                       f"tokens) plus max_tokens ({max_tokens}) exceeds the model length "
                       f"{max_model_len}", param="prompt", code="context_length_exceeded")


def _has_images(body: dict[str, Any]) -> bool:
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            return True
    return False


async def _collect(handle: Any) -> tuple[list[int], str | None]:
    ids: list[int] = []
    reason = None
    async for out in handle:
        ids.append(out.token_id)
        if out.finished:
            reason = out.finish_reason
    return ids, reason
