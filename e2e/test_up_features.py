"""The operations features from the fleet ``make run`` starts (``kvroute up``, sim workers),
each turned on as docs/operations.md says: API keys and their quotas (a keys file through
``--router-arg``), ``/v1/responses`` and ``/v1/messages`` behind those keys, the
autoscaling signal on ``/metrics``, and tracing (``OTEL_EXPORTER_OTLP_ENDPOINT`` in the
environment ``kvroute up`` hands its children) into a real collector (e2e.collector)."""

from __future__ import annotations

import secrets
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.collector import CollectedSpan, Collector, required_agent
from e2e.harness import NOT_YET, Process, metric
from httpapi.api_keys import hash_line
from kvroute.up import free_port
from tests.support.eventually import eventually_blocking

AGENT = required_agent()

SYSTEM = "You are a careful assistant. Answer briefly and cite the source. " * 8  # 520 bytes
TEAM, SMALL = "kvr-" + secrets.token_hex(16), "kvr-" + secrets.token_hex(16)


class Up(Process):
    """``kvroute up --workers 2`` with a keys file, as ``make run ARGS=...`` runs it."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        keys = log_dir / "keys.txt"
        # SMALL's quota (64 tokens a minute) is less than one of the prompts below.
        keys.write_text(f"{hash_line(TEAM, name='team-a')}\n"
                        f"{hash_line(SMALL, name='small', tokens_per_minute=64)}\n")
        self.port = free_port()
        super().__init__("kvroute-up", [
            "up", "--workers", "2", "--port", str(self.port), "--status-interval", "3600",
            "--log-dir", str(log_dir / "fleet"), f"--router-arg=--api-keys-file={keys}"],
            env, log_dir)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        def up() -> bool:
            if not self.alive():
                raise AssertionError(f"kvroute up exited:\n{self.tail()}")
            return "kvroute is up" in self.log.read_text(errors="replace")
        eventually_blocking(up, "kvroute up to print that it is up", timeout, tolerate=NOT_YET)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM, as Ctrl-C: ``kvroute up`` stops its children."""
        super().kill(sig)
        self.client.close()


@pytest.fixture
def fleet(tmp_path: Path, processes: list[Process]) -> Iterator[tuple[Up, Collector]]:
    collector = Collector(AGENT, tmp_path)
    collector.start()
    processes.append(collector)
    collector.wait_healthy()
    up = Up(tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.http_url,
                       "OTEL_BSP_SCHEDULE_DELAY": "50"})
    up.start()
    processes.append(up)
    up.wait_healthy()
    yield up, collector
    # The fleet's own logs, for a failure (the processes fixture prints kvroute up's).
    for log in sorted((tmp_path / "fleet").glob("*.log")):
        print(f"---- {log.name} ----\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_quotas_both_apis_the_demand_signal_and_traces_from_kvroute_up(
        fleet: tuple[Up, Collector]) -> None:
    up, collector = fleet
    client = up.client
    chat = {"model": "kvroute-sim", "max_tokens": 4,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Question one?"}]}
    # API keys: none or an unknown one is 401 before the body is read; a known one passes,
    # as a bearer token (OpenAI's clients) or as x-api-key (Anthropic's).
    missing = client.post("/v1/chat/completions", json=chat)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert client.post("/v1/chat/completions", json=chat,
                       headers=bearer("kvr-unknown")).status_code == 401
    trace_id = secrets.token_hex(16)
    answer = client.post("/v1/chat/completions", json=chat, headers={
        **bearer(TEAM), "traceparent": f"00-{trace_id}-{'b' * 16}-01"})
    assert answer.status_code == 200, answer.text
    responses = client.post("/v1/responses", headers=bearer(TEAM), json={
        "model": "kvroute-sim", "instructions": SYSTEM, "input": "Question two?",
        "max_output_tokens": 4})
    assert responses.status_code == 200, responses.text
    assert responses.json()["object"] == "response"
    messages = client.post("/v1/messages", headers={"x-api-key": TEAM}, json={
        "model": "kvroute-sim", "system": SYSTEM, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Question three?"}]})
    assert messages.status_code == 200, messages.text
    assert messages.json()["type"] == "message"
    # A prompt over a minute's quota is refused, and waiting cannot help: no Retry-After.
    over = client.post("/v1/chat/completions", json=chat, headers=bearer(SMALL))
    assert over.status_code == 429 and "retry-after" not in over.headers, over.headers
    assert over.json()["error"]["code"] == "rate_limit_exceeded"

    # The autoscaling signal: the uncached prompt tokens routed against the fleet's
    # prefill capacity, both above zero after the traffic above.
    text = client.get("/metrics").text
    assert metric(text, "kvroute_uncached_prompt_tokens_per_second") > 0
    assert metric(text, "kvroute_prefill_capacity_tokens_per_second") > 0
    assert metric(text, "kvroute_prefill_demand_ratio") > 0
    assert metric(text, "kvroute_api_key_requests_total", key="team-a", outcome="admitted") == 3
    assert metric(text, "kvroute_api_key_requests_total", key="small",
                  outcome="too_large") == 1
    assert metric(text, "kvroute_api_key_unauthorized_total") == 2

    # Tracing: the router and the chosen worker, both children of kvroute up, export to
    # the collector; the chat request's trace holds the router's span, its upstream
    # attempt, and the worker's span under that attempt.
    def arrived(spans: list[CollectedSpan]) -> bool:
        names = [s.name for s in spans if s.service == "kvroute-router"]
        return (names.count("POST /v1/chat/completions") == 4  # the 401s and the 429 too
                and {"POST /v1/responses", "POST /v1/messages"} <= set(names)
                and {(s.service, s.name) for s in spans if s.trace_id == trace_id} == {
                    ("kvroute-router", "POST /v1/chat/completions"),
                    ("kvroute-router", "upstream POST /v1/chat/completions"),
                    ("kvroute-worker", "POST /v1/chat/completions")})

    spans = collector.wait_for(arrived, "the router's span of each request, and the traced "
                               "chat request's three")
    mine = {s.name if s.service == "kvroute-router" else "worker": s
            for s in spans if s.trace_id == trace_id}
    request = mine["POST /v1/chat/completions"]
    upstream = mine["upstream POST /v1/chat/completions"]
    assert request.parent_id == "b" * 16
    assert request.attributes["kvroute.worker.url"] == answer.headers["x-kvroute-worker"]
    assert upstream.parent_id == request.span_id and mine["worker"].parent_id == upstream.span_id
    statuses = sorted(s.attributes["http.response.status_code"] for s in spans
                      if s.service == "kvroute-router" and s.name == "POST /v1/chat/completions")
    assert statuses == [200, 401, 401, 429]
