"""The router's HTTP boundary against real sockets on 127.0.0.1: body limits enforced while
reading, deep nesting, the OpenAI schema, admin-only debug endpoints, clients that leave
mid-body, prompts refused by length alone, and connection limits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from httpapi.server import LEAN_ENV, ConnectionLimits
from router.http.app import create_app
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.raw_http import (
    closed_by_peer,
    get_with_header,
    leave_mid_body,
    open_idle,
    post_chunked_then_pause,
    post_declared,
    stream_chunked,
)
from tests.support.servers import ScriptedWorker, UvicornServer

BODY = {"model": "kvroute-sim", "prompt": "hello router " * 8, "max_tokens": 4}
MiB = 1024 * 1024


@contextlib.asynccontextmanager
async def router(*workers: ScriptedWorker, limits: ConnectionLimits | None = None,
                 **kw: Any) -> AsyncIterator[tuple[UvicornServer, httpx.AsyncClient]]:
    """A real router on 127.0.0.1 in front of ``workers`` (all healthy), and a client."""
    settings = RouterSettings(workers=tuple(w.url for w in workers), health_interval=0.1,
                              seed=3, **kw)
    app = create_app(settings)
    async with UvicornServer(app, limits=limits or ConnectionLimits()) as server, \
            httpx.AsyncClient(base_url=server.url) as client:
        await eventually(lambda: client.get("/ready"), f"{len(workers)} workers ready",
                         until=lambda r: r.status_code == 200
                         and r.json()["workers"] == len(workers))
        yield server, client


async def metric(client: httpx.AsyncClient, name: str, labels: str) -> float:
    text = (await client.get("/metrics")).text
    found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_a_declared_oversized_body_is_refused_before_it_is_sent() -> None:
    async with ScriptedWorker() as worker, router(worker) as (server, _):
        answer = await post_declared(server.port, "/v1/completions", 64 * MiB + 1)
    assert answer.status == 413
    assert answer.headers["connection"] == "close"
    assert worker.requests == []


async def test_a_chunked_body_is_refused_as_it_passes_the_limit() -> None:
    async with ScriptedWorker() as worker, router(worker, max_body_bytes=MiB) as (server, _):
        answer, sent = await stream_chunked(server.port, "/v1/completions", chunk=64 * 1024,
                                            cap=256 * MiB)
    assert answer.status == 413
    # the server stopped reading at the limit: only socket buffers' worth more went out
    assert sent < 64 * MiB
    assert worker.requests == []


async def test_a_deeply_nested_body_is_a_400() -> None:
    deep = b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        r = await client.post("/v1/completions", content=deep,
                              headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, change, param", [
    ("/v1/completions", {"model": ["a"]}, "model"),
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"temperature": 2.5}, "temperature"),
    ("/v1/completions", {"top_p": 1.5}, "top_p"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"stream_options": 3}, "stream_options"),
    ("/v1/completions", {"stream_options": {"include_usage": "y"}},
     "stream_options.include_usage"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [3]}, "messages[0]"),
])
async def test_a_field_of_the_wrong_type_or_range_is_a_400_naming_it(
        path: str, change: dict[str, Any], param: str) -> None:
    body = {**BODY, **change}
    if path.endswith("chat/completions"):
        body.pop("prompt")
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param.split(".")[0].split("[")[0] in error["message"]
    assert worker.requests == [], "nothing reached a worker"


async def test_fields_the_schema_does_not_know_pass_through_to_the_worker() -> None:
    body = {**BODY, "temperature": 0.7, "priority": 3, "vllm_xargs": {"a": [1, 2]}}
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert worker.requests == [body]


async def test_debug_endpoints_need_the_admin_token_when_one_is_set() -> None:
    auth = {"Authorization": "Bearer s3cret"}
    async with ScriptedWorker() as worker, router(worker, admin_token="s3cret") as (_, client):
        assert (await client.post("/debug/route", json=BODY)).status_code == 401
        assert (await client.get("/debug/index/0")).status_code == 401
        r = await client.post("/debug/route", json=BODY, headers=auth)
        assert r.status_code == 200 and r.json()["chosen"] == worker.url
        worker_id = r.json()["chosen_id"]
        assert (await client.get(f"/debug/index/{worker_id}", headers=auth)).status_code == 200


async def test_a_client_leaving_mid_body_is_counted_not_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with ScriptedWorker() as worker, router(worker) as (server, client):
        for _ in range(3):
            await leave_mid_body(server.port, "/v1/completions")
        await eventually(lambda: metric(client, "kvroute_client_disconnects_total",
                                        'stage="body"'), "3 disconnects counted",
                         until=lambda n: n >= 3)
        assert await metric(client, "kvroute_client_disconnects_total", 'stage="body"') == 3
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert worker.requests == []


async def test_a_prompt_longer_than_the_model_by_its_length_alone_is_refused() -> None:
    # The scripted worker's model takes 100000 tokens; a byte-level token is one byte.
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        r = await client.post("/v1/completions", json={**BODY, "prompt": "a" * 200_000})
        fits = await client.post("/v1/completions", json={**BODY, "prompt": "a" * 50_000})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "at least 200000 tokens" in error["message"], "refused before encoding"
    assert fits.status_code == 200
    assert len(worker.requests) == 1


async def test_a_large_body_is_encoded_off_the_event_loop_and_still_routed() -> None:
    # 50000 NUL characters: 50000 tokens, but 300 KB of JSON ("\u0000" each), so the body
    # is over the off-loop threshold (256 KiB) while the prompt fits the model.
    prompt = "\x00" * 50_000 + "tail"
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        r = await client.post("/v1/completions", json={**BODY, "prompt": prompt})
        chat = await client.post("/v1/chat/completions", json={
            "model": "kvroute-sim", "max_tokens": 1,
            "messages": [{"role": "user", "content": "d" * 300_000}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-worker"] == worker.url
    assert worker.requests[0]["prompt"] == prompt
    # a chat body gets no bound by length: it is encoded, then refused
    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" not in chat.json()["error"]["message"]


async def test_requests_past_the_connection_limit_get_503_not_a_hang() -> None:
    limits = ConnectionLimits(max_connections=8, header_timeout=30)
    async with ScriptedWorker() as worker, router(worker, limits=limits) as (server, _):
        idle = await open_idle(server.port, 12)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as fresh:
                r = await fresh.get("/health")
        finally:
            for _, writer in idle:
                writer.close()
    assert r.status_code == 503


async def test_a_connection_that_sends_no_headers_is_closed() -> None:
    limits = ConnectionLimits(header_timeout=0.3)
    async with ScriptedWorker() as worker, router(worker, limits=limits) as (server, client):
        [(reader, writer)] = await open_idle(server.port, 1)
        try:
            assert await closed_by_peer(reader, within=5)
        finally:
            writer.close()
        assert (await client.get("/health")).status_code == 200


async def test_a_body_that_stops_arriving_is_answered_408_and_its_connection_closed() -> None:
    limits = ConnectionLimits(body_idle_timeout=0.2)
    refusal = 'reason="body_idle_timeout"'
    async with ScriptedWorker() as worker, router(worker, limits=limits) as (server, client):
        before = await metric(client, "kvroute_http_refusals_total", refusal)
        answer, closed = await post_chunked_then_pause(server.port, "/v1/completions",
                                                       b'{"prompt": "slow')
        after = await metric(client, "kvroute_http_refusals_total", refusal)
        assert (await client.get("/health")).status_code == 200
    assert answer.status == 408
    assert answer.headers["connection"] == "close" and closed
    assert after == before + 1
    assert worker.requests == []


async def test_headers_past_the_limit_are_answered_431_and_the_connection_closed() -> None:
    refusal = 'reason="headers_too_large"'
    async with ScriptedWorker() as worker, router(worker) as (server, client):
        before = await metric(client, "kvroute_http_refusals_total", refusal)
        answer, closed = await get_with_header(server.port, "/health", 2 * MiB)
        after = await metric(client, "kvroute_http_refusals_total", refusal)
        fits = await client.get("/health", headers={"X-Padding": "a" * 32 * 1024})
    assert answer.status == 431
    assert answer.headers["connection"] == "close" and closed
    assert after == before + 1
    assert fits.status_code == 200


async def _leave_after_sending(port: int, body: dict[str, Any], read_until: bytes) -> None:
    """POST ``body`` to the router, read until ``read_until`` arrived (nothing: no wait),
    then hang up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json"
                 b"\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw))
    await writer.drain()
    if read_until:
        async with asyncio.timeout(10):
            await reader.readuntil(read_until)
    writer.close()


@pytest.mark.parametrize("lean", ["1", "0"])
async def test_a_client_that_leaves_ends_its_upstream_request(
        lean: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(LEAN_ENV, lean)
    caplog.set_level(logging.INFO, "router.http.request_path")
    async with ScriptedWorker("slow") as worker, router(worker) as (server, client):
        # before the answer began (the worker takes 10 s): counted at once, and logged with
        # where it was (not queued: sent to its worker)
        await _leave_after_sending(server.port, BODY, b"")
        await eventually(lambda: metric(client, "kvroute_client_disconnects_total",
                                        'stage="answer"'), "the disconnect counted")
        said = [r.getMessage() for r in caplog.records if r.name == "router.http.request_path"]
        assert len(said) == 1 and re.fullmatch(
            rf"the client left before its answer: 0\.0 s queued in flow control, then "
            rf"\d+\.\d s sent to {re.escape(worker.url)} \(and any tried after it\) with no "
            rf"answer begun", said[0]), said
        # mid-stream: the upstream stream is closed
        await _leave_after_sending(server.port, {**BODY, "stream": True}, b"data: ")
        await eventually(worker.cancelled.is_set, "the worker to see the stream closed")
        # both bookings released
        await eventually(lambda: client.get("/metrics"), "nothing left in flight",
                         until=lambda r: re.search(r"^kvroute_requests_in_flight\{.*\} 0\.0$",
                                                   r.text, re.M))
