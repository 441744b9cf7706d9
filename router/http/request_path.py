"""One request's path through the router: ``POST /v1/completions`` and
``POST /v1/chat/completions`` as raw ASGI apps (:mod:`httpapi.app` rule 5).

Read the body within its byte limit, check it against the OpenAI schema,
:meth:`RouterService.decide`, book the load, forward through the :class:`~router.http.proxy.Proxy`,
pass the answer back as it arrives. A worker that fails before the first byte is left for the
next-best one (:mod:`router.http.failover`); the answer names the worker and the matched blocks
in ``x-kvroute-*`` headers.

A completions prompt whose length alone proves it longer than every worker's model is refused
before it is encoded; a body the service says is worth it
(:meth:`~router.service.RouterService.tokenizes_off_loop`: over ``TOKENIZE_OFF_LOOP_BYTES``
under ``--tokenize full``) is encoded in a thread, not on the event loop.

A client that hangs up is only seen on the ASGI receive channel: one watcher task, started
once the body is read, cancels the handler when the client leaves, so the upstream request is
cancelled with it (before the answer began: counted, answered 499) or the stream is closed
(after). One watcher that cancels the handler is cheaper than racing two tasks, and cheaper
than the task group Starlette's ``StreamingResponse`` runs per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Mapping
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from httpapi.body import receive_body, wait_for_disconnect
from httpapi.responses import CLIENT_GONE_STATUS
from openai_request.bodies import ApiError, fewest_prompt_tokens, parse_body, validate_request
from openai_request.prompts import PromptTokens
from router.http.disaggregated import prefill_remotely
from router.http.failover import Sent, send_with_failover
from router.http.flow import ask_of, tenant_of
from router.http.metrics import RequestTimer
from router.http.proxy import UpstreamUnavailable
from router.http.state import RouterState
from router.service import Route

__all__ = ["Forward", "decide", "route_of"]

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_SSE = b"text/event-stream; charset=utf-8"
_JSON = b"application/json"


class Forward:
    """The ASGI app that routes and forwards ``kind`` requests arriving at ``path``."""

    __slots__ = ("kind", "path", "state")

    def __init__(self, state: RouterState, kind: str, path: str) -> None:
        self.state = state
        self.kind = kind
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state, path = self.state, self.path
        metrics = state.metrics
        timer = metrics.timer(time.perf_counter())
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        max_bytes = state.settings.max_body_bytes
        try:
            raw = await receive_body(headers.get("content-length"), receive, max_bytes)
            body = parse_body(raw, max_bytes)
            route = await decide(state, body, self.kind, len(raw), headers)
        except ApiError as exc:
            metrics.request(path, exc.status)
            raise
        metrics.decided(route)
        this = asyncio.current_task()
        assert this is not None, "a request handler runs in a task"
        watcher = asyncio.get_running_loop().create_task(wait_for_disconnect(receive))
        watcher.add_done_callback(lambda w: w.cancelled() or this.cancel())
        stream = bool(body.get("stream"))
        answering = False
        timer.sending()
        try:
            try:
                if route.prefill is not None:  # disaggregated: the prefill step first
                    raw = await prefill_remotely(state, route, path, body, raw, headers)
                sent = await send_with_failover(state.service, state.proxy, state.first_byte,
                                                route, path, raw, headers, stream,
                                                metrics.upstream_failure)
            except ApiError as exc:
                metrics.request(path, exc.status)
                raise
            metrics.request(path, sent.answer.status)
            streamed = stream and sent.answer.status == 200
            timer.answered(sent.worker, sent.answer.status, streamed)
            if streamed:
                answering = True
                await _relay(state, sent, route, send, watcher, timer)
            else:
                start, content = await _whole(state, sent, route, timer)
                watcher.cancel()
                await send(start)
                await send({"type": "http.response.body", "body": content})
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled():  # the client left, not a shutdown
                this.uncancel()
                if not answering:
                    state.service.finished(route)
                    state.client_gone("answer")
                    await send({"type": "http.response.start", "status": CLIENT_GONE_STATUS,
                                "headers": [(b"content-length", b"0")]})
                    await send({"type": "http.response.body", "body": b""})
                return
            raise
        finally:
            watcher.cancel()


async def decide(state: RouterState, body: dict[str, Any], kind: str, size: int,
                 headers: Mapping[str, str]) -> Route:
    """Route ``body`` (:func:`route_of`) through flow control (:mod:`router.http.flow`: it
    may wait while the fleet is saturated).

    Raises:
        ApiError: :func:`route_of`'s; flow control's 429s; 400 for a malformed priority or
            deadline.
    """
    ask = ask_of(body, headers)
    route = await route_of(state, body, kind, size)
    return await state.flow.admit(route, ask,
                                  lambda: state.service.decide(body, kind, route.prompt),
                                  lambda: tenant_of(body, headers))


async def route_of(state: RouterState, body: dict[str, Any], kind: str, size: int) -> Route:
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
    if service.tokenizes_off_loop(size):
        prompt = await asyncio.to_thread(service.tokenize, body, kind)
    return service.decide(body, kind, prompt)


def _start(sent: Sent, route: Route, default_type: bytes, length: int | None = None
           ) -> Message:
    """The ``http.response.start`` message: the worker's headers, its content type (or
    ``default_type``), the ``x-kvroute-*`` headers and, for a whole answer, its length."""
    answer, worker = sent.answer, sent.worker
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
               for k, v in answer.headers.items()]
    if not any(k == b"content-type" for k, _ in headers):
        headers.append((b"content-type", default_type))
    matched = route.decision.chosen.matched_blocks if worker is route.worker else 0
    headers += [(b"x-kvroute-worker", worker.url.encode("latin-1")),
                (b"x-kvroute-worker-id", str(worker.id).encode()),
                (b"x-kvroute-matched-blocks", str(matched).encode())]
    if worker.rank is not None:
        headers.append((b"x-kvroute-worker-rank", str(worker.rank).encode()))
    if route.predicts_ttft and worker is route.worker:
        ms = route.decision.chosen.cost * 1e3
        headers.append((b"x-kvroute-predicted-ttft-ms", f"{ms:.1f}".encode()))
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http.response.start", "status": answer.status, "headers": headers}


async def _whole(state: RouterState, sent: Sent, route: Route, timer: RequestTimer
                 ) -> tuple[Message, bytes]:
    """Read a whole answer; return its start message and body."""
    broken = False
    try:
        content = await sent.answer.read()
    except UpstreamUnavailable as exc:
        broken = True
        raise ApiError(502, str(exc), "upstream_error") from None
    finally:
        state.service.finished(route)
        timer.done(broken)
    found = _CACHED.search(content)
    if found and sent.answer.status == 200:
        state.metrics.reported_cached(route, int(found.group(1)))
    return _start(sent, route, _JSON, len(content)), content


async def _relay(state: RouterState, sent: Sent, route: Route, send: Send,
                 watcher: asyncio.Task[None], timer: RequestTimer) -> None:
    """Pass a stream back chunk by chunk; the first chunk marks the first token."""
    service = state.service
    try:
        await send(_start(sent, route, _SSE))
        first = True
        async with contextlib.aclosing(sent.answer.stream()) as chunks:
            async for chunk in chunks:
                if first:
                    service.first_token(route)
                    first = False
                found = _CACHED.search(chunk)
                if found:
                    state.metrics.reported_cached(route, int(found.group(1)))
                timer.chunk(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        # The last send completes the response, which wakes the watcher: stop it first.
        watcher.cancel()
        await send({"type": "http.response.body", "body": b""})
    finally:
        service.finished(route)
        timer.done(sent.answer.broken)
