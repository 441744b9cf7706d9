"""OpenTelemetry tracing of the forwarding endpoints; off unless ``--tracing on`` or the
environment sets ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the ``otel`` extra installs the SDK).

One span per request, and one child per upstream attempt:

- ``POST /v1/...`` (kind SERVER), a child of the client's W3C ``traceparent`` when it sends
  one: the decision (``kvroute.worker.id``, ``kvroute.worker.url``,
  ``kvroute.matched_blocks``, ``kvroute.prompt_tokens``, ``kvroute.predicted_ttft_ms`` under
  ``--policy kv``, ``kvroute.decision_us``), the answer (``http.response.status_code``) and
  the delivered time to first token (``kvroute.ttft_ms``: arrival to the answer's first body
  bytes leaving the router, the ``kvroute_time_to_first_token_seconds`` clock);
- ``upstream POST /v1/...`` (kind CLIENT) for each worker tried, whose ``traceparent`` the
  worker receives, so an engine that traces (vLLM's ``--otlp-traces-endpoint``) hangs its
  spans under it. An attempt that failed before answering ends with an error status when
  the next begins; the last ends with the request.

The spans go through the SDK's batch processor to an OTLP exporter configured by the SDK's
own environment (:mod:`httpapi.tracing`; ``OTEL_SERVICE_NAME``, default ``kvroute-router``).
The request path reaches the current request's record through a context variable: with
tracing off it is never set, and the hooks cost one look-up.

The OpenTelemetry packages are imported only when tracing starts (the app's lifespan makes
the :class:`~httpapi.tracing.Tracing`).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from httpapi.body import ClientGone
from httpapi.responses import CLIENT_GONE_STATUS
from httpapi.tracing import Tracing

if TYPE_CHECKING:
    from router.fleet.entry import Target
    from router.service import Route

__all__ = ["SERVICE_NAME", "Traced", "annotate", "router_tracing", "traced_headers"]

#: The router's ``service.name`` unless ``OTEL_SERVICE_NAME`` names another.
SERVICE_NAME = "kvroute-router"


def router_tracing(exporter: Any = None) -> Tracing:
    """The router's :class:`~httpapi.tracing.Tracing` (``exporter``: None for OTLP)."""
    return Tracing(SERVICE_NAME, "kvroute.router", exporter)


class _Request:
    """One traced request: its span, the upstream attempt's span, when it arrived."""

    __slots__ = ("arrived", "first_byte", "span", "status", "tracing", "upstream")

    def __init__(self, tracing: Tracing, span: Any) -> None:
        self.tracing = tracing
        self.span = span
        self.upstream: Any = None
        self.arrived = time.perf_counter()
        self.first_byte: float | None = None
        self.status: int | None = None


_CURRENT: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "kvroute_trace", default=None)


def annotate(route: Route) -> None:
    """Put ``route``'s decision on the current request's span (nothing when untraced)."""
    request = _CURRENT.get()
    if request is None:
        return
    chosen = route.decision.chosen
    attributes: dict[str, Any] = {
        "kvroute.request_id": route.request_id, "kvroute.worker.id": route.worker.id,
        "kvroute.worker.url": route.worker.url, "kvroute.matched_blocks": chosen.matched_blocks,
        "kvroute.prompt_tokens": route.prompt.total_tokens,
        "kvroute.decision_us": round(route.decision_seconds * 1e6, 1)}
    if route.predicts_ttft:
        attributes["kvroute.predicted_ttft_ms"] = round(route.predicted_ttft_s * 1e3, 3)
    request.span.set_attributes(attributes)


def traced_headers(headers: Mapping[str, str], worker: Target, attempt: int, path: str
                   ) -> Mapping[str, str]:
    """``headers`` for an upstream attempt: unchanged when untraced; else a new CLIENT span
    for it (the previous attempt's ended as failed) and its ``traceparent`` in them."""
    request = _CURRENT.get()
    if request is None:
        return headers
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    if request.upstream is not None:
        request.upstream.set_status(Status(StatusCode.ERROR, "failed before answering"))
        request.upstream.end()
    tracing = request.tracing
    span = tracing.tracer.start_span(
        f"upstream POST {path}", context=trace.set_span_in_context(request.span),
        kind=SpanKind.CLIENT,
        attributes={"server.address": worker.url, "kvroute.worker.id": worker.id,
                    "kvroute.attempt": attempt, "url.full": f"{worker.url}{path}"})
    request.upstream = span
    carrier: dict[str, str] = {}
    tracing.propagator.inject(carrier, context=trace.set_span_in_context(span))
    kept = {k: v for k, v in headers.items() if k not in ("traceparent", "tracestate")}
    return {**kept, **carrier}


class Traced:
    """A raw route (:mod:`httpapi.app` rule 5) inside a request span (module docstring)."""

    __slots__ = ("app", "path", "tracing")

    def __init__(self, app: ASGIApp, path: str, tracing: Any) -> None:
        self.app = app
        self.path = path
        #: The :class:`Tracing`, or a callable giving it (made when the lifespan starts).
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from opentelemetry.trace import SpanKind

        tracing: Tracing = self.tracing() if callable(self.tracing) else self.tracing
        span = tracing.tracer.start_span(
            f"POST {self.path}", context=tracing.extract(scope["headers"]),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": self.path})
        request = _Request(tracing, span)
        token = _CURRENT.set(request)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                request.status = message["status"]
            elif message["type"] == "http.response.body" and request.first_byte is None \
                    and message.get("body"):
                request.first_byte = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException as exc:
            _finish(request, exc)
            raise
        else:
            _finish(request, None)
        finally:
            _CURRENT.reset(token)


def _finish(request: _Request, failure: BaseException | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    span, upstream = request.span, request.upstream
    status = request.status
    if failure is not None and status is None:  # answered by the app: an ApiError's status
        status = CLIENT_GONE_STATUS if isinstance(failure, ClientGone) else getattr(
            failure, "status", 500)
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if request.first_byte is not None:
        span.set_attribute("kvroute.ttft_ms",
                           round((request.first_byte - request.arrived) * 1e3, 3))
    failed = status is None or status >= 500
    if upstream is not None:
        if status is not None:
            upstream.set_attribute("http.response.status_code", status)
        if failed:
            upstream.set_status(Status(StatusCode.ERROR))
        upstream.end()
    if failed:
        span.set_status(Status(StatusCode.ERROR))
    span.end()
