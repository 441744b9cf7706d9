"""One request's path through the router: ``POST /v1/completions`` and
``POST /v1/chat/completions`` as raw ASGI apps (:mod:`httpapi.app` rule 5).

Read the body within its byte limit, check it against the OpenAI schema,
:meth:`RouterService.decide`, book the load, forward through the :class:`~router.http.proxy.Proxy`,
pass the answer back as it arrives. A long prompt whose body arrives in pieces may be decided
before its end (under ``--tokenize match``, once what arrived settles the match:
:mod:`openai_request.early_body`); the upstream request then starts at once and the rest of
the body follows it as it arrives (:mod:`router.http.incoming_body`: the same limits and
deadlines, the bytes kept for a failover). A body the router must rewrite (a disaggregated
prefill's) or one refused as it stands is read whole first, as is one that arrived whole. A
worker that fails before the first byte is left for the next-best one
(:mod:`router.http.failover`); the answer names the worker and the matched blocks in
``x-kvroute-*`` headers (and the peer it was told to fetch from, ``x-kvroute-fetch-source``).
A client's own fetch instruction headers are dropped on arrival (:func:`without_fetch`).

A completions prompt whose length alone proves it longer than every worker's model is refused
before it is encoded; a body the service says is worth it
(:meth:`~router.service.RouterService.tokenizes_off_loop`: over ``TOKENIZE_OFF_LOOP_BYTES``
under ``--tokenize full``) is encoded in a thread, not on the event loop.

A client that hangs up cancels the handler through one watcher, so the upstream request is
cancelled with it (before the answer began: counted, answered 499) or the stream is closed
(after): the server's own notice of a client that left (:data:`httpapi.lean_cycle.DEPARTURE`,
a future) once the body is whole, where the server gives one; else a task (the body's pump,
reading what is left of it first) that waits on the ASGI receive channel. One watcher that
cancels the handler is cheaper than racing two tasks, and cheaper than the task group
Starlette's ``StreamingResponse`` runs per stream; a future is cheaper than a task. A
body that fails after it began upstream (413, 408, the client gone) ends the pump the same
way, and the handler answers that failure instead.

The same watcher is flow control's while the request waits in its queue
(:meth:`~router.http.flow.FlowControl.admit` asks for it only then, so a request admitted at
once makes none there): a client that leaves while queued takes its request out of the queue
at once, with nothing booked, counted as ``stage="queue"`` and answered 499; a body still
arriving that fails while queued is answered with that failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from httpapi.body import ClientGone
from httpapi.lean_cycle import DEPARTURE
from httpapi.responses import CLIENT_GONE_STATUS
from openai_request.bodies import ApiError, fewest_prompt_tokens, parse_body, validate_request
from openai_request.early_body import EarlyBody
from openai_request.prompts import PromptTokens
from router.http.client_fields import (
    refuse_transfer_fields,
    whole_body_check,
    without_rank_header,
)
from router.http.client_trust import flow_view
from router.http.disaggregated import send_disaggregated
from router.http.failover import Sent, send_with_failover
from router.http.flow import Departed, ask_of, tenant_of
from router.http.incoming_body import IncomingBody
from router.http.metrics import RequestTimer
from router.http.proxy import UpstreamUnavailable
from router.http.state import RouterState
from router.routing.dispatch_gate import QueueStay
from router.service import Route

log = logging.getLogger(__name__)

__all__ = ["Departure", "Forward", "decide", "route_of", "without_fetch"]

#: Gives a future that completes when the client has left (the same one at each call).
Departure = Callable[[], asyncio.Future[None]]

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_SSE = b"text/event-stream; charset=utf-8"
_JSON = b"application/json"


def without_fetch(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` less any peer fetch instruction a client sent (``x-kvroute-fetch-*``,
    ``x-kvroute-transfer-token``): only the router instructs a worker to fetch."""
    for name in [k for k in headers if _instructs_fetch(k)]:
        del headers[name]
    return headers


def _instructs_fetch(name: str) -> bool:
    return name.startswith("x-kvroute-") and (name.startswith("x-kvroute-fetch-")
                                              or name == "x-kvroute-transfer-token")


def _client_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers (an ASGI scope's), decoded and :func:`without_fetch`, in one
    pass."""
    headers = {}
    for k, v in raw:
        name = k.decode("latin-1")
        if not (name.startswith("x-kvroute-") and _instructs_fetch(name)):
            headers[name] = v.decode("latin-1")
    return headers


def _stop_watching(watcher: asyncio.Future[None],
                   on_end: Callable[[asyncio.Future[None]], None]) -> None:
    """Cancel ``watcher`` without its end callback: cancelled with the callback still on
    it, the future would schedule the callback (a no-op for a cancelled watcher) for the
    loop's next turn, one more loop callback a request. A watcher that ended already has
    its callback scheduled, and it runs."""
    if not watcher.done():
        watcher.remove_done_callback(on_end)
        watcher.cancel()


async def _answer_gone(send: Send) -> None:
    """Answer a client that left before its answer: an empty 499, for the server's log."""
    await send({"type": "http.response.start", "status": CLIENT_GONE_STATUS,
                "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


class _Pump:
    """The client's departure where the server gives no notice of it: the body's pump
    (:meth:`IncomingBody.pump`) in a task, started at the first call, the same task after."""

    __slots__ = ("_incoming", "_loop", "task")

    def __init__(self, incoming: IncomingBody, loop: asyncio.AbstractEventLoop) -> None:
        self._incoming = incoming
        self._loop = loop
        self.task: asyncio.Task[None] | None = None

    def __call__(self) -> asyncio.Task[None]:
        task = self.task
        if task is None:
            task = self.task = self._loop.create_task(self._incoming.pump())
        return task

    def stop(self) -> None:
        """Cancel the task, if it was started."""
        if self.task is not None:
            self.task.cancel()


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
        headers = _client_headers(scope["headers"])
        max_bytes = state.settings.max_body_bytes
        if not state.settings.allow_client_transfer_fields:
            headers = without_rank_header(headers)
        trusted = state.trusted_clients.trusts(scope.get("client"))
        if not trusted:  # its flow-control headers are not believed, nor sent upstream
            headers = dict(flow_view({}, headers, trusted=False)[1])
        try:
            incoming = IncomingBody(receive, headers.get("content-length"), max_bytes)
        except ApiError as exc:
            metrics.request(path, exc.status)
            raise
        # Once the body is whole, the server's own notice of a client that left, where it
        # gives one (the same future at each call); else the body's pump, made when asked.
        departure: Departure = scope.get(DEPARTURE) or _Pump(incoming, state.loop)
        try:
            route, body, pump = await self._decided(incoming, headers, trusted, departure)
        except Departed as left:  # in flow control's queue: nothing was booked
            await self._left_queue(left, send)
            return
        except BaseException as exc:
            if isinstance(departure, _Pump):  # a refusal after a wait in the queue
                departure.stop()
            if isinstance(exc, ApiError):
                metrics.request(path, exc.status)
            raise
        metrics.decided(route)
        this = asyncio.current_task(state.loop)  # the loop given: no system call to find it
        assert this is not None, "a request handler runs in a task"
        # The pump reads what is left of the body, then waits for the client to leave; its
        # end (the client left, or the body failed) cancels the handler.
        watcher = pump or departure()

        def on_end(w: asyncio.Future[None]) -> None:
            if not w.cancelled():
                this.cancel()

        watcher.add_done_callback(on_end)
        answering = False
        timer.sending()
        sending_at = time.monotonic()
        try:
            if body is None and route.prefill is not None:
                await incoming.ended()  # the prefill step rewrites the body: all of it first
                body = parse_body(incoming.whole(), max_bytes)
            payload: bytes | IncomingBody
            stream: bool | Callable[[], bool]
            if body is not None:
                payload, stream = incoming.whole(), bool(body.get("stream"))
            else:
                payload = incoming
                stream = functools.cache(lambda: _asks_stream(incoming, max_bytes))
            try:
                if route.prefill is not None:  # disaggregated: the prefill step first
                    assert body is not None and isinstance(payload, bytes), "read whole above"
                    sent = await send_disaggregated(state, route, path, body, payload, headers,
                                                    bool(body.get("stream")),
                                                    metrics.upstream_failure)
                else:
                    sent = await send_with_failover(state.service, state.proxy,
                                                    state.first_byte, route, path, payload,
                                                    headers, stream, metrics.upstream_failure)
            except ApiError as exc:
                metrics.request(path, exc.status)
                raise
            metrics.request(path, sent.answer.status)
            stream = stream() if callable(stream) else stream
            streamed = stream and sent.answer.status == 200
            timer.answered(sent.worker, sent.answer.status, streamed)
            if streamed:
                answering = True
                await _relay(state, sent, route, send, watcher, timer)
            else:
                start, content = await _whole(state, sent, route, timer)
                _stop_watching(watcher, on_end)
                await send(start)
                await send({"type": "http.response.body", "body": content})
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled():  # the client left, not a shutdown
                this.uncancel()
                failure = watcher.exception()
                if not answering:
                    state.service.finished(route)
                    if failure is not None:  # the body failed after it began upstream
                        if isinstance(failure, ApiError):
                            metrics.request(path, failure.status)
                        raise failure from None
                    state.client_gone("answer")
                    log.info("the client left before its answer: %s",
                             _where(route, time.monotonic() - sending_at))
                    await _answer_gone(send)
                return
            raise
        finally:
            _stop_watching(watcher, on_end)

    async def _left_queue(self, left: Departed, send: Send) -> None:
        """Answer a request whose client left while it waited in flow control's queue (499,
        counted); a body that failed while it waited is answered with its failure."""
        failure = left.failure
        if failure is not None and not isinstance(failure, ClientGone):
            if isinstance(failure, ApiError):
                self.state.metrics.request(self.path, failure.status)
            raise failure from None
        self.state.client_gone("queue")
        log.info("the client left while its request waited %.1f s in flow control's queue",
                 left.waited_s)
        await _answer_gone(send)

    async def _decided(self, incoming: IncomingBody, headers: Mapping[str, str], trusted: bool,
                       departure: Departure
                       ) -> tuple[Route, dict[str, Any] | None, asyncio.Future[None] | None]:
        """Read ``incoming`` until the request is decided: at the body's end (the route, the
        parsed body, no pump), or before it, once what arrived settles the match (the route,
        ``None`` and the pump already reading the rest: :mod:`openai_request.early_body` says when a
        body may be decided early and on what). ``departure`` gives the client's departure
        once the body is whole, for flow control's queue (a body decided early gives the
        pump's end instead).

        Raises:
            ApiError: the body's refusals (413, 408, 400) and :func:`decide`'s.
            ClientGone: the client left before the body's end.
            Departed: the client left while the request waited in flow control's queue.
        """
        state, kind = self.state, self.kind
        service = state.service
        chunk = await incoming.read_more()
        # Only a body still arriving is read as it comes (most arrive in one message).
        early = (EarlyBody(kind, incoming.declared, service.only_model())
                 if not incoming.complete and service.decides_early else None)
        while not incoming.complete:
            tries = early.feed(chunk) if early is not None else None
            if tries is not None and service.settles(tries[0], kind):
                # Checked again once whole, before its end goes upstream (client_fields).
                incoming.check = whole_body_check(state.settings.max_body_bytes,
                                                  state.settings.allow_client_transfer_fields)
                reading = _Pump(incoming, state.loop)  # its end is the client's departure
                pump = reading()
                try:
                    route = await decide(state, tries[1], kind,
                                         incoming.declared or incoming.size, headers, trusted,
                                         reading)
                except ApiError:  # refused as it stands: answered as buffered, at its end
                    await _stopped(pump)
                    early = None
                except BaseException:
                    pump.cancel()
                    raise
                else:
                    return route, None, pump
            chunk = await incoming.read_more()
        raw = incoming.whole()
        body = parse_body(raw, state.settings.max_body_bytes)
        return (await decide(state, body, kind, len(raw), headers, trusted, departure), body,
                None)


async def decide(state: RouterState, body: dict[str, Any], kind: str, size: int,
                 headers: Mapping[str, str], trusted: bool = True,
                 departure: Departure | None = None) -> Route:
    """Route ``body`` (:func:`route_of`) through flow control (:mod:`router.http.flow`: it
    may wait while the fleet is saturated), which reads the tenant, priority and deadline
    a ``trusted`` client gives (:mod:`router.http.client_trust`); ``departure`` gives the
    client's departure, which ends a wait in its queue.

    Raises:
        ApiError: :func:`route_of`'s; flow control's 429s; 400 for a malformed priority or
            deadline.
        Departed: the client left while the request waited.
    """
    asked, seen = flow_view(body, headers, trusted)
    ask = ask_of(asked, seen)
    service = state.service
    if service.tokenizes_off_loop(size):
        route = await route_of(state, body, kind, size)
    else:  # route_of without its coroutine: nothing here waits
        _check(state, body, kind)
        route = service.decide(body, kind)
    if state.access is not None:  # the key's quota (router.http.client_quotas): 429
        state.access.charge(headers, route.prompt.total_tokens)
    flow = state.flow
    admitted = flow.admit_now(route, ask, lambda: tenant_of(asked, seen))
    if admitted is not None:  # flow.admit without its coroutine: it goes at once
        return admitted
    return await flow.wait_for_room(route, ask, lambda: tenant_of(asked, seen), departure)


async def route_of(state: RouterState, body: dict[str, Any], kind: str, size: int) -> Route:
    """Check ``body`` (``size`` bytes long) as a ``kind`` request and route it.

    Raises:
        ApiError: 400 for a body that is not a valid request, or a prompt provably longer
            than every worker's model; the service's refusals (no worker, unknown model).
    """
    service = state.service
    _check(state, body, kind)
    prompt: PromptTokens | None = None
    if service.tokenizes_off_loop(size):
        prompt = await asyncio.to_thread(service.tokenize, body, kind)
    return service.decide(body, kind, prompt)


def _check(state: RouterState, body: dict[str, Any], kind: str) -> None:
    """:func:`route_of`'s checks of ``body`` before it is tokenized."""
    service = state.service
    request = validate_request(body, kind)  # type: ignore[arg-type]
    if not state.settings.allow_client_transfer_fields:
        refuse_transfer_fields(body)
    fewest = fewest_prompt_tokens(request, service.max_bytes_per_token)
    # Refused here only when longer than every worker's model (a worker of unknown
    # length takes anything); the service routes it to a worker it fits.
    max_len = service.prompt_bound(body)
    if max_len and fewest > max_len:
        raise ApiError(400, f"the prompt has at least {fewest} tokens, more than the "
                       f"model's {max_len}", param="prompt", code="context_length_exceeded")


def _where(route: Route, at_workers_s: float) -> str:
    """Where a request whose client left before its answer spent its time: in flow
    control's queue, then sent to its workers with no answer begun (a log line)."""
    queued = route.queued.waited_s if route.queued is not None else 0.0
    return (f"{queued:.1f} s queued in flow control, then {at_workers_s:.1f} s sent to "
            f"{route.worker.url} (and any tried after it) with no answer begun")


def _queue_headers(stay: QueueStay) -> list[tuple[bytes, bytes]]:
    """The ``x-kvroute-queue-*`` headers of a request that waited in flow control's queue:
    the milliseconds it waited, the requests waiting ahead of it and in all when it joined."""
    return [(b"x-kvroute-queued-ms", f"{stay.waited_s * 1e3:.1f}".encode()),
            (b"x-kvroute-queue-ahead", str(stay.ahead).encode()),
            (b"x-kvroute-queue-length", str(stay.length).encode())]


def _start(sent: Sent, route: Route, default_type: bytes, length: int | None = None
           ) -> Message:
    """The ``http.response.start`` message: the worker's headers, its content type (or
    ``default_type``), the ``x-kvroute-*`` headers and, for a whole answer, its length."""
    answer, worker = sent.answer, sent.worker
    headers = [(k.lower(), v) for k, v in answer.raw_headers]
    # Built per answer: bytes formatting, and no generator for the content type's search.
    if b"content-type" not in [k for k, _ in headers]:
        headers.append((b"content-type", default_type))
    chosen = worker is route.worker
    headers += [(b"x-kvroute-worker", worker.url.encode("latin-1")),
                (b"x-kvroute-worker-id", b"%d" % worker.id),
                (b"x-kvroute-matched-blocks",
                 b"%d" % (route.decision.chosen.matched_blocks if chosen else 0))]
    if worker.rank is not None:
        headers.append((b"x-kvroute-worker-rank", b"%d" % worker.rank))
    fetch = route.fetch_from(worker)
    if fetch is not None:
        headers.append((b"x-kvroute-fetch-source", fetch[0].url.encode("latin-1")))
    if route.predicts_ttft and chosen:
        headers.append((b"x-kvroute-predicted-ttft-ms", b"%.1f" % (route.predicted_ttft_s * 1e3)))
    if route.queued is not None:
        headers += _queue_headers(route.queued)
    if length is not None:
        headers.append((b"content-length", b"%d" % length))
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


async def _stopped(pump: asyncio.Task[None]) -> None:
    """Stop ``pump``, which read the body ahead of an early decision that did not stand;
    raise what ended the body if that was a failure."""
    pump.cancel()
    await asyncio.wait([pump])
    failure = None if pump.cancelled() else pump.exception()
    if failure is not None:
        raise failure


def _asks_stream(incoming: IncomingBody, max_bytes: int) -> bool:
    """Whether a body sent as it arrived asks for a stream: read once it is whole (a body
    still arriving when a worker answered, or not valid JSON, does not; the worker said what
    was wrong with it)."""
    if not incoming.complete:
        return False
    if isinstance(incoming.checked, dict):  # parsed by its check at its end
        return bool(incoming.checked.get("stream"))
    try:
        return bool(parse_body(incoming.whole(), max_bytes).get("stream"))
    except ApiError:
        return False


async def _relay(state: RouterState, sent: Sent, route: Route, send: Send,
                 watcher: asyncio.Future[None], timer: RequestTimer) -> None:
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
