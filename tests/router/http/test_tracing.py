"""OpenTelemetry tracing against an OTLP/HTTP receiver in this process that decodes the
protobuf export (opentelemetry-proto), as a collector would: a span per request carrying the
decision, a child per upstream attempt, the W3C traceparent passed on to the worker."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from router.http.app import create_app
from router.settings import RouterSettings, SettingsError, load_settings
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, UvicornServer

try:
    import opentelemetry.exporter.otlp.proto.http.trace_exporter
    import opentelemetry.sdk.trace  # noqa: F401
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )
except ImportError as exc:  # the otel extra (in dev) is missing
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"the OpenTelemetry packages are not installed: {exc}", allow_module_level=True)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


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
        # serve_forever looks for shutdown() between polls, every 0.5 s unless told
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.01}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    r = Receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    yield r
    r.close()


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind)
    return out


async def test_a_request_span_carries_the_decision_and_its_upstream_child(
        receiver: Receiver) -> None:
    async with ScriptedWorker("refuse") as refusing, ScriptedWorker() as worker:
        settings = RouterSettings(workers=(refusing.url, worker.url), health_interval=0.1,
                                  seed=3, tracing=True, rates="prefill=0.001",
                                  learn_rates=False)
        async with UvicornServer(create_app(settings)) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await eventually(lambda: client.get("/ready"), "two workers ready",
                             until=lambda r: r.status_code == 200
                             and r.json()["workers"] == 2)
            # Long enough that the refusing worker is tried first, whichever it is: the
            # body's prompt is sent until one answers.
            answers = []
            for i in range(4):
                r = await client.post("/v1/completions", headers={
                    "traceparent": f"00-{TRACE}-{PARENT}-01"}, json={
                    "model": "kvroute-sim", "prompt": f"<{i}>" + "z" * 200,
                    "max_tokens": 1, "stream": True})
                assert r.status_code == 200, r.text
                answers.append(r)
        # The router stopped: its last spans are exported.
    spans = [s for _, s in receiver.spans]
    assert {service for service, _ in receiver.spans} == {"kvroute-router"}
    requests = [s for s in spans if s.name == "POST /v1/completions"]
    upstream = [s for s in spans if s.name == "upstream POST /v1/completions"]
    assert len(requests) == 4
    for span in requests:
        a = attrs(span)
        assert span.trace_id.hex() == TRACE and span.parent_span_id.hex() == PARENT
        assert span.kind == span.SPAN_KIND_SERVER
        assert a["http.response.status_code"] == 200
        assert a["kvroute.matched_blocks"] >= 0 and a["kvroute.prompt_tokens"] == 204
        assert a["kvroute.predicted_ttft_ms"] > 0 and a["kvroute.ttft_ms"] > 0
        assert a["kvroute.worker.url"] in (refusing.url, worker.url)
        children = [u for u in upstream if u.parent_span_id == span.span_id]
        assert children and all(u.kind == u.SPAN_KIND_CLIENT for u in children)
        # Every attempt but the last failed before answering; the last went to the worker
        # that answered, which received its traceparent.
        *failed, last = sorted(children, key=lambda u: attrs(u)["kvroute.attempt"])
        assert all(attrs(u)["server.address"] == refusing.url
                   and u.status.code == u.status.STATUS_CODE_ERROR for u in failed)
        assert attrs(last)["server.address"] == worker.url
        assert attrs(last)["http.response.status_code"] == 200
        assert f"00-{TRACE}-{last.span_id.hex()}-01" in [
            h.get("traceparent") for h in worker.headers]
    assert any(attrs(u)["server.address"] == refusing.url for u in upstream)


async def test_a_refusal_is_traced_with_its_status(receiver: Receiver) -> None:
    async with ScriptedWorker() as worker:
        settings = RouterSettings(workers=(worker.url,), health_interval=0.1, tracing=True)
        async with UvicornServer(create_app(settings)) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await eventually(lambda: client.get("/ready"), "the worker ready",
                             until=lambda r: r.status_code == 200)
            r = await client.post("/v1/chat/completions", json={"model": "kvroute-sim"})
            assert r.status_code == 400
    (span,) = [s for _, s in receiver.spans]
    assert span.name == "POST /v1/chat/completions" and len(span.trace_id) == 16
    assert attrs(span)["http.response.status_code"] == 400
    assert "kvroute.worker.id" not in attrs(span)


def test_an_otlp_endpoint_in_the_environment_turns_tracing_on() -> None:
    assert load_settings({}, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).tracing
    assert not load_settings({}, env={}).tracing
    assert not load_settings({"tracing": "off"},
                             env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).tracing


def test_tracing_without_the_sdk_stops_the_start_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(SettingsError, match=r"kvroute\[otel\]"):
        RouterSettings(tracing=True)
