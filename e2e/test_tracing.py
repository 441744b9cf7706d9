"""Tracing into a real OpenTelemetry collector (Rotel's agent, e2e.collector): the router's
and the workers' spans arrive over OTLP/HTTP when only the environment names the endpoint,
and over OTLP/gRPC with ``--tracing on`` (beside the traces endpoint's variable: alone, the
flag exports to the SDK's default ``localhost:4317``, which a test cannot own), each request
one trace: the router's span with its
decision, the upstream attempt as its child, and the chosen worker's span under that
attempt, so the W3C traceparent the router sent reached the worker.

Every request carries a ``traceparent`` of its own, so the test finds each request's spans
by trace id and compares them with the answer's ``x-kvroute-*`` headers. Each worker names
itself in its resource (``OTEL_RESOURCE_ATTRIBUTES``, ``service.instance.id=URL``), so the
worker span shows which worker continued the trace.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.collector import CollectedSpan, Collector, required_agent
from e2e.harness import NOT_YET, Process, Router, Worker
from tests.support.eventually import eventually_blocking

AGENT = required_agent()

SYSTEM = "You are a careful assistant. Answer briefly and cite the source. " * 8  # 520 bytes
#: The SDK's batch processor exports within 50 ms (its default: 5 s).
EXPORT_SOON = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


@pytest.fixture
def collector(tmp_path: Path, processes: list[Process]) -> Collector:
    c = Collector(AGENT, tmp_path)
    c.start()
    processes.append(c)
    c.wait_healthy()
    return c


def traced(trace_id: str) -> dict[str, str]:
    """A client's ``traceparent`` header: trace ``trace_id``, parent span 16 x 'a'."""
    return {"traceparent": f"00-{trace_id}-{'a' * 16}-01"}


def one(spans: list[CollectedSpan], what: str, **where: str) -> CollectedSpan:
    """The one span whose fields equal ``where``; an AssertionError naming ``what`` else."""
    found = [s for s in spans if all(getattr(s, k) == v for k, v in where.items())]
    assert len(found) == 1, f"{what}: {len(found)} spans with {where} in the trace: {spans}"
    return found[0]


def exported(spans: list[CollectedSpan], requests: int) -> bool:
    """Whether every span of ``requests`` requests has arrived, whatever its trace: the
    router's two and the worker's one each (which trace each is in, check_trace says)."""
    services = [s.service for s in spans]
    return (services.count("kvroute-router") >= 2 * requests
            and services.count("kvroute-worker") >= requests)


def check_trace(spans: list[CollectedSpan], trace_id: str, path: str,
                answer: httpx.Response) -> CollectedSpan:
    """Assert that ``answer``'s trace holds the router's span with the decision the
    answer's headers name, its upstream child and the chosen worker's span under that;
    return the router's span."""
    mine = [s for s in spans if s.trace_id == trace_id]
    request = one(mine, f"the router's span of {path}", name=f"POST {path}",
                  service="kvroute-router")
    assert request.kind == "SPAN_KIND_SERVER" and request.parent_id == "a" * 16, request
    decision = request.attributes
    assert decision["kvroute.worker.url"] == answer.headers["x-kvroute-worker"], decision
    assert decision["kvroute.worker.id"] == int(answer.headers["x-kvroute-worker-id"])
    assert decision["kvroute.matched_blocks"] == int(answer.headers["x-kvroute-matched-blocks"])
    # The header rounds the prediction to 0.1 ms, the attribute to 1 µs.
    predicted = float(answer.headers["x-kvroute-predicted-ttft-ms"])
    assert abs(decision["kvroute.predicted_ttft_ms"] - predicted) <= 0.05, decision
    assert decision["kvroute.prompt_tokens"] > 0 and decision["kvroute.ttft_ms"] > 0
    assert decision["http.response.status_code"] == 200
    upstream = one(mine, "the upstream attempt", name=f"upstream POST {path}")
    assert upstream.kind == "SPAN_KIND_CLIENT" and upstream.parent_id == request.span_id
    assert upstream.attributes["server.address"] == answer.headers["x-kvroute-worker"]
    assert upstream.attributes["http.response.status_code"] == 200
    worker = one(mine, "the worker's span", service="kvroute-worker")
    assert worker.name == f"POST {path}" and worker.kind == "SPAN_KIND_SERVER", worker
    assert worker.parent_id == upstream.span_id, (worker, upstream)
    assert worker.resource["service.instance.id"] == answer.headers["x-kvroute-worker"]
    assert worker.attributes["http.response.status_code"] == 200
    assert all(s.status == "STATUS_CODE_UNSET" for s in mine), mine
    return request


def start_fleet(tmp_path: Path, processes: list[Process], workers: int,
                otel: dict[str, str], flag: list[str]) -> Router:
    """``workers`` sim workers and a router, each with ``otel`` in its environment and
    ``flag`` on its command line; ready."""
    ws = [Worker(i, tmp_path) for i in range(workers)]
    for w in ws:
        w.env |= otel | EXPORT_SOON | {
            "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={w.url}"}
        w.args += flag
        w.start()
        processes.append(w)
    for w in ws:
        w.wait_healthy()
    router = Router("router", ws, tmp_path)
    router.env |= otel | EXPORT_SOON
    router.args += flag
    router.start()
    processes.append(router)
    router.wait_ready(workers)
    return router


def chat(router: Router, text: str, trace_id: str, **extra: Any) -> httpx.Response:
    answer = router.client.post("/v1/chat/completions", headers=traced(trace_id), json={
        "model": "kvroute-sim", "max_tokens": 4, **extra,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]})
    assert answer.status_code == 200, answer.text
    return answer


def test_spans_reach_the_collector_over_otlp_http_when_the_environment_names_it(
        tmp_path: Path, processes: list[Process], collector: Collector) -> None:
    router = start_fleet(tmp_path, processes, 2,
                         {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.http_url}, [])
    ids = [secrets.token_hex(16) for _ in range(4)]
    first = chat(router, "Question one?", ids[0])
    holder = first.headers["x-kvroute-worker"]
    # The holder's events reach the router; then a follow-up matches its cached prefix.
    eventually_blocking(lambda: router.entry(holder)["blocks"]["device"] > 0,
                        "the holder's blocks in the router's index", tolerate=NOT_YET)
    follow = chat(router, "Question two, a different one?", ids[1])
    assert follow.headers["x-kvroute-worker"] == holder
    assert int(follow.headers["x-kvroute-matched-blocks"]) > 0
    responses = router.client.post("/v1/responses", headers=traced(ids[2]), json={
        "model": "kvroute-sim", "instructions": SYSTEM, "input": "Question three?",
        "max_output_tokens": 4})
    messages = router.client.post("/v1/messages", headers=traced(ids[3]), json={
        "model": "kvroute-sim", "system": SYSTEM, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Question four?"}]})
    assert responses.status_code == messages.status_code == 200, (responses.text, messages.text)

    spans = collector.wait_for(lambda spans: exported(spans, len(ids)),
                               "two router spans and a worker span for each of 4 requests")
    check_trace(spans, ids[0], "/v1/chat/completions", first)
    again = check_trace(spans, ids[1], "/v1/chat/completions", follow)
    assert again.attributes["kvroute.matched_blocks"] > 0
    check_trace(spans, ids[2], "/v1/responses", responses)
    check_trace(spans, ids[3], "/v1/messages", messages)


def test_spans_reach_the_collector_over_otlp_grpc_with_the_flag_on(
        tmp_path: Path, processes: list[Process], collector: Collector) -> None:
    router = start_fleet(tmp_path, processes, 1, {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.grpc_url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["--tracing", "on"])
    trace_id = secrets.token_hex(16)
    streamed = chat(router, "A streamed question?", trace_id, stream=True)
    assert "[DONE]" in streamed.text
    spans = collector.wait_for(lambda spans: exported(spans, 1),
                               "the streamed request's three spans over OTLP/gRPC")
    check_trace(spans, trace_id, "/v1/chat/completions", streamed)
