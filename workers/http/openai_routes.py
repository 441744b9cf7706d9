"""The worker's OpenAI surface: ``POST /v1/completions``, ``POST /v1/chat/completions``
(streaming or not), ``POST /v1/responses`` and Anthropic's ``POST /v1/messages`` (run as chat,
answered in their own shapes: :mod:`workers.http.dialects`) and ``GET /v1/models``.

Every malformed request gets an OpenAI-style JSON error with a 4xx status and the reason, and
is refused before the engine sees it: nothing half-applied stays in the cache. A body is read
within its byte limit and checked against the OpenAI schema
(:func:`openai_request.bodies.validate_request`) first; a completions prompt whose length alone
proves it too long for the model is refused before it is encoded, and a large body is encoded
in a thread rather than on the event loop.

Before a request is queued, its KV may come from elsewhere: a decode request's
``kv_transfer_params`` (:mod:`workers.http.kv_transfer`), then a trusted peer fetch
instruction (:mod:`workers.http.kv_fetch`, answered with ``x-kvroute-fetch-result``).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from httpapi.body import TOKENIZE_OFF_LOOP_BYTES, read_body, wait_for_disconnect
from httpapi.responses import CLIENT_GONE_STATUS
from openai_request.bodies import (
    ApiError,
    error_body,
    fewest_prompt_tokens,
    parse_body,
    validate_request,
)
from openai_request.prompts import build_prompt
from workers.cache.block_keys import Prompt, Scope
from workers.engine.loop import Engine, RequestFailed, RequestHandle
from workers.http.dialects import DIALECTS, Dialect, MessagesReply, ResponsesReply
from workers.http.image_fetch import ImageLimit, remote_image_digests
from workers.http.kv_fetch import RESULT_HEADER, FetchResult, parse_instruction
from workers.http.kv_transfer import answer_params, parse_transfer, receive
from workers.http.openai_format import Completion, sse
from workers.http.state import WorkerState

__all__ = ["DEFAULT_MAX_TOKENS", "add_openai_routes"]

DEFAULT_MAX_TOKENS = 16
#: An answer's shape: OpenAI's, or another API's (workers.http.dialects).
Reply = Completion | ResponsesReply | MessagesReply


def add_openai_routes(app: FastAPI, state: WorkerState) -> None:
    """Add the module docstring's endpoints to ``app``, serving from ``state``."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(state, request, chat=True)

    for path, dialect in DIALECTS.items():
        app.add_api_route(path, functools.partial(_dialect, state, dialect), methods=["POST"])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        settings = state.settings
        names = [settings.model, *settings.loras]
        return {"object": "list", "data": [{"id": m, "object": "model",
                                            "created": state.runtime.started_at,
                                            "owned_by": "kvroute"}
                                           for m in names]}


async def _dialect(state: WorkerState, dialect: Dialect, request: Request) -> Response:
    return await generate(state, request, chat=True, dialect=dialect)


async def generate(state: WorkerState, request: Request, chat: bool,
                   dialect: Dialect | None = None) -> Response:
    """Check, encode and run one completions (or, with ``chat``, chat) request; with
    ``dialect``, a body of another API run as chat and answered in its shape."""
    settings, runtime = state.settings, state.runtime
    raw = await read_body(request, settings.max_body_bytes)
    started = time.perf_counter()
    body = parse_body(raw, settings.max_body_bytes)
    if dialect is not None:
        try:
            body = dialect.chat_body(body)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
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
    try:
        digests = (await remote_image_digests(body, settings, budget=state.image_budget)
                   if chat else {})
    except ImageLimit as exc:
        state.metrics.image_limits.labels(exc.limit).inc()
        raise
    except ValueError as exc:  # its messages or mm_uuids, read before any fetch
        raise ApiError(400, str(exc)) from None
    encode = functools.partial(
        build_prompt, body, "chat" if chat else "completions", runtime.tokenizer,
        mm_tokens_per_image=settings.mm_tokens_per_image,
        max_image_bytes=settings.max_image_bytes, fetch=None,
        digests=lambda url, uuid: digests.get((url, uuid)))
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
    transfer = parse_transfer(body)
    state.held_prefills.expire()
    engine = runtime.rank_engine(_pinned_rank(request, len(runtime.engines)))
    headers = _timing(started)
    try:
        prompt = Prompt(tuple(tokens.token_ids), tuple(tokens.images), scope)
        if transfer is not None and transfer.remote_blocks:
            # Rule 4 of workers.http.transfer_auth: the secret goes to the prefill worker the
            # params name only when the router's token came with them.
            auth = state.transfer_auth.outgoing(state.transfer_auth.router_token_valid(request))
            received, failure = await receive(settings, engine, prompt, transfer, state.peers,
                                              auth)
            state.metrics.transferred_tokens.inc(received)
            if failure is not None:
                state.metrics.transfer_failures.inc()
        fetch_result = await _fetch(state, request, engine, prompt)
        if fetch_result is not None:
            headers[RESULT_HEADER] = fetch_result.header()
        handle = runtime.submit(f"req-{uuid.uuid4().hex}", prompt, max_tokens, engine)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    kind, prefix = (Completion, "chatcmpl" if chat else "cmpl") if dialect is None else (
        dialect.reply, dialect.prefix)
    reply = kind(f"{prefix}-{uuid.uuid4().hex}", model, chat, int(time.time()),
                 len(tokens.token_ids))
    state.metrics.requests.labels("chat" if chat else "completions").inc()
    if checked.stream:
        headers.update(_timing(started))
        return StreamingResponse(_stream(state, handle, reply, checked.include_usage),
                                 media_type="text/event-stream", headers=headers)
    extra = None
    if transfer is not None and transfer.remote_decode:  # prefill for a decode worker
        def extra() -> dict[str, Any]:  # once it ended: its blocks held, under a lease
            lease = state.held_prefills.hold(engine, prompt)
            return {"kv_transfer_params": answer_params(settings, runtime.instance_id,
                                                        len(tokens.token_ids), lease)}
    return await _whole(state, request, handle, reply, started, extra, headers)


async def _fetch(state: WorkerState, request: Request, engine: Engine, prompt: Prompt
                 ) -> FetchResult | None:
    """Follow the request's peer fetch instruction (:mod:`workers.http.kv_fetch`), if it has
    one; None when it has none. A failed, untrusted or malformed one is counted, and the
    request computes the prompt itself."""
    fetcher, auth = state.fetcher, state.transfer_auth
    try:
        instruction = parse_instruction(request.headers)
    except ValueError as exc:
        result = fetcher.failed("bad_instruction", str(exc))
    else:
        if instruction is None:
            return None
        if auth.trusts_instruction(request, instruction.source):
            result = await fetcher.fetch(engine, prompt, instruction, auth.outgoing(True))
        else:
            result = fetcher.failed("untrusted", f"the instruction to fetch from "
                                    f"{instruction.source} is not authenticated "
                                    "(workers.http.transfer_auth)")
    metrics = state.metrics
    metrics.kv_fetch.labels(result.outcome).inc()
    if result.outcome == "fetched":
        metrics.kv_fetch_blocks.inc(result.blocks)
        metrics.kv_fetch_seconds.observe(result.seconds)
        metrics.kv_fetch_transfers.labels(result.transfer).inc()
    if result.ipc_fallback is not None:
        metrics.kv_ipc_fallbacks.labels(result.ipc_fallback).inc()
    return result


def _timing(started: float) -> dict[str, str]:
    """The ``Server-Timing`` header: the worker's own milliseconds from the body's end to its
    answer (a stream's start), which a benchmark subtracts to compare paths to it fairly."""
    return {"server-timing": f"worker;dur={(time.perf_counter() - started) * 1e3:.3f}"}


async def _whole(state: WorkerState, request: Request, handle: RequestHandle,
                 reply: Reply, started: float,
                 extra: Callable[[], dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    collect = asyncio.ensure_future(_collect(handle))
    gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not collect.done():
        collect.cancel()
        handle.cancel()
        state.client_gone("answer")
        return JSONResponse({"error": "client went away"}, status_code=CLIENT_GONE_STATUS)
    try:
        ids, reason = collect.result()
    except RequestFailed as exc:
        raise ApiError(500, f"the engine failed the request: {exc}", "server_error") from None
    reply.cached_tokens = handle.num_cached_tokens or 0
    state.metrics.finished(reply, len(ids))
    answer = reply.whole(state.runtime.tokenizer.decode(ids), reason, len(ids))
    return JSONResponse({**answer, **extra()} if extra else answer,
                        headers={**(headers or {}), **_timing(started)})


async def _stream(state: WorkerState, handle: RequestHandle, reply: Reply, usage: bool
                  ) -> AsyncIterator[bytes]:
    decode = state.runtime.tokenizer.decode
    count, first = 0, True
    try:
        try:
            async for out in handle:
                count += 1
                yield reply.chunk(decode([out.token_id]),
                                  out.finish_reason if out.finished else None, first=first)
                first = False
        except RequestFailed as exc:
            yield sse(error_body(ApiError(500, f"the engine failed the request: {exc}",
                                          "server_error")))
            yield sse("[DONE]")
            return
        reply.cached_tokens = handle.num_cached_tokens or 0
        state.metrics.finished(reply, count)
        yield reply.closing(count, usage)
    finally:
        handle.cancel()


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


async def _collect(handle: RequestHandle) -> tuple[list[int], str | None]:
    ids: list[int] = []
    reason = None
    async for out in handle:
        ids.append(out.token_id)
        if out.finished:
            reason = out.finish_reason
    return ids, reason


def _pinned_rank(request: Request, ranks: int) -> int | None:
    """The data-parallel rank the ``X-data-parallel-rank`` header pins, or None (any rank).
    A worker of one rank ignores the header, as a vLLM server without data parallelism does.

    Raises:
        ApiError: a header that is not one of this worker's ranks (400).
    """
    value = request.headers.get("x-data-parallel-rank")
    if value is None or ranks == 1:
        return None
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if not 0 <= rank < ranks:
        raise ApiError(400, f"X-data-parallel-rank {value!r} is not one of this worker's "
                       f"ranks 0..{ranks - 1}", param="X-data-parallel-rank")
    return rank
