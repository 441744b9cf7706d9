"""OpenTelemetry tracing of the worker's generation endpoints; off unless ``--tracing on`` or
the environment names an OTLP endpoint (:mod:`httpapi.tracing`; the ``otel`` extra).

One span per request to ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` or
``/v1/messages``: ``POST /v1/...`` (kind SERVER, service ``kvroute-worker``), a child of the
W3C ``traceparent`` the request arrived with. Behind the router that is the router's
``upstream POST /v1/...`` span, so one trace holds the router's decision, each attempt and
the worker's answer, as with vLLM's ``--otlp-traces-endpoint``. Its attributes:
``http.request.method``, ``url.path``, ``http.response.status_code`` and ``kvroute.ttft_ms``
(arrival to the answer's first body bytes); it ends with an error status when the answer is
a 5xx or none was sent. Other paths (health, load polls, KV transfer) are not traced.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from httpapi.tracing import Tracing

__all__ = ["SERVICE_NAME", "TRACED_PATHS", "TracedRequests", "worker_tracing"]

#: The worker's ``service.name`` unless ``OTEL_SERVICE_NAME`` names another.
SERVICE_NAME = "kvroute-worker"
TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                          "/v1/messages"})


def worker_tracing(exporter: Any = None) -> Tracing:
    """The worker's :class:`~httpapi.tracing.Tracing` (``exporter``: None for OTLP)."""
    return Tracing(SERVICE_NAME, "kvroute.worker", exporter)


class TracedRequests:
    """ASGI middleware: a span around each ``POST`` to :data:`TRACED_PATHS` (module
    docstring); every other request passes untouched.

    Args:
        app: the app inside.
        tracing: a callable giving the :class:`~httpapi.tracing.Tracing`, or None while
            there is none (before the app's lifespan has made it).
    """

    def __init__(self, app: ASGIApp, tracing: Any) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracing: Tracing | None = self.tracing()
        if (tracing is None or scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] not in TRACED_PATHS):
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        path = scope["path"]
        span = tracing.tracer.start_span(
            f"POST {path}", context=tracing.extract(scope["headers"]), kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": path})
        arrived = time.perf_counter()
        status: int | None = None
        first_byte: float | None = None

        async def sending(message: Message) -> None:
            nonlocal status, first_byte
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
            elif message["type"] == "http.response.body" and first_byte is None \
                    and message.get("body"):
                first_byte = time.perf_counter()
                span.set_attribute("kvroute.ttft_ms", round((first_byte - arrived) * 1e3, 3))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if status is None or status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
