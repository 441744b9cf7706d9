"""An OTLP/HTTP trace receiver in the test's process: ``POST /v1/traces``, the protobuf export
decoded with opentelemetry-proto (the ``otel`` extra), as a collector would, and every span
kept with its resource's ``service.name``. ``e2e/collector.py`` runs a real collector."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["Receiver", "attrs", "receiving"]


class Receiver:
    """An OTLP/HTTP trace receiver: ``POST /v1/traces``, protobuf in, spans kept."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["content-length"]))
                assert self.path == "/v1/traces"
                assert self.headers["content-type"] == "application/x-protobuf"
                export = ExportTraceServiceRequest.FromString(raw)
                for resource in export.resource_spans:
                    service = {a.key: a.value.string_value
                               for a in resource.resource.attributes}["service.name"]
                    for scope in resource.scope_spans:
                        receiver.spans += [(service, s) for s in scope.spans]
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def receiving(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """A :class:`Receiver` that this process's tracing exports to (its environment points
    the SDK at it, with a 20 ms batch delay), closed at the end."""
    r = Receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    try:
        yield r
    finally:
        r.close()


def attrs(span: Any) -> dict[str, Any]:
    """A decoded span's attributes as a dict of plain values."""
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind)
    return out
