"""The worker's OpenAI-compatible HTTP API, in front of one engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``GET /model_info``, ``GET /load``, and,
behind the admin token when one is set, ``POST /reset_prefix_cache``, ``GET /kv/snapshot``
and ``POST /debug/drop_events`` (fault injection: withhold the next N event batches from the
live socket, as a PUB socket at its high-water mark would).

Every malformed request gets an OpenAI-style JSON error with a 4xx status and the reason, and
is refused before the engine sees it: nothing half-applied stays in the cache.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from indexer.openai_api import (
    ApiError,
    check_bearer,
    error_body,
    parse_body,
    wait_for_disconnect,
)
from indexer.prompts import build_prompt
from indexer.wire import encode_batch
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


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if value is None:
        return DEFAULT_MAX_TOKENS
    if type(value) is not int or value < 1:
        raise ApiError(400, f"max_tokens must be a positive integer, got {value!r}",
                       param="max_tokens")
    return value


def _check_common(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, f"only n=1 is supported, got {n!r}", param="n")
    salt = body.get("cache_salt")
    if salt is not None and (type(salt) is not str or not salt):
        raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")
    options = body.get("stream_options")
    if options is not None and type(options) is not dict:
        raise ApiError(400, "stream_options must be an object", param="stream_options")


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

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        metrics.refused.labels(str(exc.status)).inc()
        return JSONResponse(error_body(exc), status_code=exc.status)

    def admin(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), settings.admin_token)

    async def generate(request: Request, chat: bool) -> Response:
        body = parse_body(await request.body())
        _check_common(body)
        model = body.get("model", settings.model)
        lora = runtime.lora_scope(model)
        if model != settings.model and lora is None:
            raise ApiError(404, f"the model {model!r} does not exist", param="model",
                           code="model_not_found")
        if chat and not settings.images and _has_images(body):
            raise ApiError(400, "this worker does not take images", param="messages")
        fetched = await fetch_remote_images(body, settings) if chat else {}
        try:
            tokens = build_prompt(body, "chat" if chat else "completions", runtime.tokenizer,
                                  mm_tokens_per_image=settings.mm_tokens_per_image,
                                  max_image_bytes=settings.max_image_bytes,
                                  fetch=fetched.get)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if any(span.digest is None for span in tokens.images):
            raise ApiError(400, "an image could not be fetched or decoded", param="messages")
        max_tokens = _max_tokens(body)
        if len(tokens.token_ids) + max_tokens > settings.max_model_len:
            raise ApiError(400, f"the prompt ({len(tokens.token_ids)} tokens) plus max_tokens "
                           f"({max_tokens}) exceeds the model length {settings.max_model_len}",
                           param="prompt", code="context_length_exceeded")
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
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(handle, reply, usage), media_type="text/event-stream")
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
            return JSONResponse({"error": "client went away"}, status_code=499)
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
        body = parse_body(await request.body())
        batches = body.get("batches")
        if type(batches) is not int or batches < 0:
            raise ApiError(400, "give {\"batches\": N} with N >= 0", param="batches")
        runtime.engine.drop_next_batches(batches)
        return {"dropping": batches}

    return app


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
