"""The OpenTelemetry SDK behind both apps' tracing (``router.http.tracing``,
``workers.http.tracing``): the one place that builds a tracer provider and its exporter.

Tracing follows the OpenTelemetry convention: an OTLP endpoint in the environment
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) turns it on unless
the app's ``tracing`` setting says otherwise (:func:`endpoint_configured`). The spans go
through the SDK's batch processor to an OTLP exporter configured by the SDK's own environment
(the endpoint, ``..._HEADERS``; ``OTEL_EXPORTER_OTLP_PROTOCOL`` or ``..._TRACES_PROTOCOL``
``grpc`` for OTLP/gRPC, else OTLP/HTTP with protobuf; ``OTEL_SERVICE_NAME`` over the app's
default service name; ``OTEL_BSP_*`` for the batch processor).

The OpenTelemetry packages (the ``otel`` extra) are imported only when a :class:`Tracing` is
made; :func:`missing_sdk` says at start-up whether they can be.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["ENDPOINT_VARIABLES", "Tracing", "endpoint_configured", "missing_sdk"]

#: The SDK's variables naming where spans go; either turns tracing on.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def endpoint_configured(env: Mapping[str, str]) -> bool:
    """Whether ``env`` names an OTLP endpoint for traces (the convention's switch)."""
    return any(env.get(name) for name in ENDPOINT_VARIABLES)


def missing_sdk(switch: str) -> str | None:
    """Why tracing cannot start here (the SDK or its OTLP exporters are not installed), as a
    sentence naming the extra and ``switch`` (the flag that turns it off); None when it can."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return (f"tracing is on ({switch} on, or {ENDPOINT_VARIABLES[0]} is set) but the "
                f"OpenTelemetry SDK is not installed ({exc}): pip install 'kvroute[otel]', "
                f"or {switch} off")
    return None


class Tracing:
    """The tracer provider, its exporter and the W3C trace-context propagator.

    Args:
        service_name: the resource's ``service.name`` unless ``OTEL_SERVICE_NAME`` sets one.
        scope: the instrumentation scope's name (the tracer's).
        exporter: where spans go (None: OTLP, configured by the environment).
    """

    def __init__(self, service_name: str, scope: str, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {
            "service.name": service_name}
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(BatchSpanProcessor(exporter or _otlp_exporter()))
        self.tracer = self.provider.get_tracer(scope)
        self.propagator = TraceContextTextMapPropagator()

    def extract(self, headers: list[tuple[bytes, bytes]]) -> Any:
        """The context of an ASGI request's ``traceparent`` and ``tracestate`` headers (the
        root context when it has none, or one that does not parse)."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
                   if k in (b"traceparent", b"tracestate")}
        return self.propagator.extract(carrier)

    def shutdown(self) -> None:
        """Export what is pending and stop."""
        self.provider.shutdown()


def _otlp_exporter() -> Any:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                              os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()
