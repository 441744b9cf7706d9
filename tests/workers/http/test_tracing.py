"""The worker's spans (workers.http.tracing) against an OTLP/HTTP receiver in this process
(tests.support.otlp): a SERVER span per generation request, the child of the traceparent it
arrived with; nothing for the other endpoints; the switch's convention and its refusal."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.http.api import create_app
from workers.settings import WorkerSettings, WorkerSettingsError, load_worker_settings

try:
    import opentelemetry.exporter.otlp.proto.http.trace_exporter
    import opentelemetry.sdk.trace  # noqa: F401

    from tests.support.otlp import Receiver, attrs, receiving
except ImportError as exc:  # the otel extra (in dev) is missing
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"the OpenTelemetry packages are not installed: {exc}", allow_module_level=True)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{TRACE}-{PARENT}-01"}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    with receiving(monkeypatch) as r:
        yield r


def fast(**kw: Any) -> WorkerSettings:
    return WorkerSettings(**{"events_port": 0, "replay_port": 0, "speedup": 1e6, **kw})


async def test_each_generation_request_is_a_child_of_its_traceparent(
        receiver: Receiver) -> None:
    app = create_app(fast(tracing=True, admin_token="t0k"))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://worker") as client:
        chat = {"model": "kvroute-sim", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        assert (await client.post("/v1/chat/completions", json=chat,
                                  headers=TRACEPARENT)).status_code == 200
        streamed = await client.post("/v1/completions", json={
            "model": "kvroute-sim", "prompt": "hello", "max_tokens": 2, "stream": True})
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        messages = {"model": "kvroute-sim", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post("/v1/messages", json=messages)).status_code == 200
        assert (await client.post("/v1/responses", json={
            "model": "kvroute-sim", "input": "hi", "max_output_tokens": 2})).status_code == 200
        assert (await client.post("/v1/chat/completions", json={})).status_code == 400
        # Neither health nor load polls, nor the control endpoints, are traced.
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/load")).status_code == 200
        assert (await client.post("/reset_prefix_cache",
                                  headers={"Authorization": "Bearer t0k"})).status_code == 200
    # The lifespan ended: the last spans are exported.
    assert {service for service, _ in receiver.spans} == {"kvroute-worker"}
    spans = [s for _, s in receiver.spans]
    assert [s.name for s in spans] == [
        "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
        "POST /v1/responses", "POST /v1/chat/completions"]
    first, *rest = spans
    assert first.trace_id.hex() == TRACE and first.parent_span_id.hex() == PARENT
    assert all(s.trace_id.hex() != TRACE and not s.parent_span_id for s in rest)
    assert all(s.kind == s.SPAN_KIND_SERVER for s in spans)
    assert [attrs(s)["http.response.status_code"] for s in spans] == [200, 200, 200, 200, 400]
    assert all(attrs(s)["kvroute.ttft_ms"] > 0 for s in spans)
    assert all(s.status.code == s.status.STATUS_CODE_UNSET for s in spans)


async def test_tracing_off_leaves_the_app_unwrapped(receiver: Receiver) -> None:
    app = create_app(fast())
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://worker") as client:
        r = await client.post("/v1/completions", headers=TRACEPARENT, json={
            "model": "kvroute-sim", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200
    assert receiver.spans == []


def test_an_otlp_endpoint_in_the_environment_turns_tracing_on() -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}
    assert load_worker_settings({}, env=endpoint).tracing
    assert not load_worker_settings({}, env={}).tracing
    assert not load_worker_settings({"tracing": "off"}, env=endpoint).tracing
    assert not load_worker_settings({}, env={**endpoint,
                                             "KVROUTE_WORKER_TRACING": "off"}).tracing


def test_tracing_without_the_sdk_stops_the_start_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(WorkerSettingsError, match=r"kvroute\[otel\].*--tracing off"):
        fast(tracing=True)
