"""The worker's HTTP boundary against real sockets on 127.0.0.1: body limits enforced while
reading, deep nesting, the OpenAI schema, clients that leave mid-body, prompts refused by
length alone, and connection limits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from httpapi.server import ConnectionLimits
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
from tests.support.servers import UvicornServer
from workers.http.api import create_app
from workers.settings import WorkerSettings

MiB = 1024 * 1024
BODY = {"prompt": "hello worker", "max_tokens": 2}


@contextlib.asynccontextmanager
async def worker(limits: ConnectionLimits | None = None, **kw: Any
                 ) -> AsyncIterator[tuple[UvicornServer, httpx.AsyncClient]]:
    settings = WorkerSettings(**{"events_port": 0, "replay_port": 0, "speedup": 1e6, **kw})
    app = create_app(settings)
    async with UvicornServer(app, limits=limits or ConnectionLimits()) as server, \
            httpx.AsyncClient(base_url=server.url) as client:
        yield server, client


async def disconnects(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    found = re.search(r'^kvroute_client_disconnects_total\{stage="body"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_a_declared_oversized_body_is_refused_before_it_is_sent() -> None:
    async with worker() as (server, client):
        answer = await post_declared(server.port, "/v1/completions", 64 * MiB + 1)
        assert (await client.get("/load")).json()["running"] == 0
    assert answer.status == 413
    assert answer.headers["connection"] == "close"


async def test_a_chunked_body_is_refused_as_it_passes_the_limit() -> None:
    async with worker(max_body_bytes=MiB) as (server, _):
        answer, sent = await stream_chunked(server.port, "/v1/chat/completions",
                                            chunk=64 * 1024, cap=256 * MiB)
    assert answer.status == 413
    assert sent < 64 * MiB, "the server stopped reading at the limit"


async def test_a_deeply_nested_body_is_a_400() -> None:
    deep = b'{"prompt": "x", "extra": ' + b"{\"a\": " * 100_000 + b"1" + b"}" * 100_000 + b"}"
    async with worker() as (_, client):
        r = await client.post("/v1/completions", content=deep,
                              headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested" in r.json()["error"]["message"]


@pytest.mark.parametrize("change, param", [
    ({"model": ["a"]}, "model"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"n": "1"}, "n"),
    ({"stop": 7}, "stop"),
    ({"logit_bias": {"5": 200}}, "logit_bias[...]"),
    ({"prompt": None}, "prompt"),
])
async def test_a_field_of_the_wrong_type_or_range_is_a_400_naming_it(
        change: dict[str, Any], param: str) -> None:
    async with worker() as (_, client):
        r = await client.post("/v1/completions", json={**BODY, **change})
        load = (await client.get("/load")).json()
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert load["running"] == load["waiting"] == 0


async def test_known_fields_in_range_and_unknown_fields_are_served() -> None:
    body = {**BODY, "model": "kvroute-sim", "temperature": 2, "top_p": 0, "stream": False,
            "stop": ["\n"], "seed": 5, "user": "u", "priority": 1, "vllm_xargs": {"k": [1]}}
    async with worker() as (_, client):
        r = await client.post("/v1/completions", json=body)
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
            "logprobs": False, "stream_options": None})
    assert r.status_code == 200, r.text
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 3


async def test_a_client_leaving_mid_body_is_counted_not_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with worker() as (server, client):
        for _ in range(3):
            await leave_mid_body(server.port, "/v1/completions")
        await eventually(lambda: disconnects(client), "3 disconnects counted",
                         until=lambda n: n >= 3)
        assert await disconnects(client) == 3
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_a_prompt_longer_than_the_model_by_its_length_alone_is_refused() -> None:
    async with worker(max_model_len=1000) as (_, client):
        r = await client.post("/v1/completions", json={**BODY, "prompt": "a" * 5000})
        ids = await client.post("/v1/completions", json={**BODY, "prompt": [5] * 2000})
    assert r.status_code == ids.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "at least 5000 tokens" in r.json()["error"]["message"]
    assert "at least 2000 tokens" in ids.json()["error"]["message"]


async def test_a_large_body_is_encoded_off_the_event_loop_and_served() -> None:
    # 300 KB of JSON for 50004 tokens: over the off-loop threshold, within the model.
    async with worker() as (_, client):
        r = await client.post("/v1/completions",
                              json={**BODY, "prompt": "\x00" * 50_000 + "tail"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 50_005  # and the BOS


async def test_requests_past_the_connection_limit_get_503_not_a_hang() -> None:
    async with worker(ConnectionLimits(max_connections=4, header_timeout=30)) as (server, _):
        idle = await open_idle(server.port, 6)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as fresh:
                r = await fresh.post("/v1/completions", json=BODY)
        finally:
            for _, writer in idle:
                writer.close()
    assert r.status_code == 503


async def test_a_connection_that_sends_no_headers_is_closed() -> None:
    async with worker(ConnectionLimits(header_timeout=0.3)) as (server, client):
        [(reader, writer)] = await open_idle(server.port, 1)
        try:
            assert await closed_by_peer(reader, within=5)
        finally:
            writer.close()
        assert (await client.get("/health")).status_code == 200


async def refusals(client: httpx.AsyncClient, reason: str) -> float:
    text = (await client.get("/metrics")).text
    found = re.search(rf'^kvroute_http_refusals_total\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_a_body_that_stops_arriving_is_answered_408_and_its_connection_closed() -> None:
    async with worker(ConnectionLimits(body_idle_timeout=0.2)) as (server, client):
        before = await refusals(client, "body_idle_timeout")
        answer, closed = await post_chunked_then_pause(server.port, "/v1/completions",
                                                       b'{"prompt": "slow')
        after = await refusals(client, "body_idle_timeout")
        assert (await client.get("/load")).json()["running"] == 0
    assert answer.status == 408
    assert answer.headers["connection"] == "close" and closed
    assert after == before + 1


async def test_headers_past_the_limit_are_answered_431_and_the_connection_closed() -> None:
    async with worker(ConnectionLimits(max_header_bytes=8 * 1024)) as (server, client):
        before = await refusals(client, "headers_too_large")
        answer, closed = await get_with_header(server.port, "/health", 64 * 1024)
        after = await refusals(client, "headers_too_large")
        fits = await client.get("/health", headers={"X-Padding": "a" * 4 * 1024})
    assert answer.status == 431
    assert answer.headers["connection"] == "close" and closed
    assert after == before + 1
    assert fits.status_code == 200


async def test_a_pipelined_oversized_head_is_refused_after_the_answer_before_it() -> None:
    big = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Padding: " + b"a" * 100_000 + b"\r\n\r\n"
    small = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    async with worker() as (server, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(small + big + small)
            await writer.drain()
            answers = await asyncio.wait_for(reader.read(), 10)  # to the close
        finally:
            writer.close()
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answers)
    assert statuses == [b"200", b"431"]
    assert answers.count(b'{"status":"ok"}') == 1
