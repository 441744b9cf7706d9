"""A long prompt decided before its body ends, against real sockets on 127.0.0.1: the upstream
request starts while the client is still sending, the worker receives the client's bytes
exactly, the body limits and deadlines still answer 413 and 408, a client that leaves
mid-body ends the upstream request, and a failover before the first byte resends the body
from its start.

Each test proves the early start the only way that cannot race: the client sends the first
part of its body, then waits (bounded) for a worker to have begun the request before it
sends the rest; a router that read the whole body first would never let it begin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from httpapi.server import ConnectionLimits
from openai_request.tokenizer import load_tokenizer
from router.http.app import create_app
from router.settings import RouterSettings
from tests.fixtures.tokenizer_files import write_tiny_tokenizer
from tests.router.http.test_app_boundary import metric
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, UvicornServer, sse_events

WAIT = 10.0
DEEP_QUEUE = b'{"running": 0, "waiting": 64, "pending_prefill_tokens": 1000000}'
PROMPT = " ".join(f"the router reads part {i} of a long prompt" for i in range(2_000))


def body_bytes(**after: Any) -> bytes:
    """A completions body with ``model`` ahead of its long prompt and ``after`` behind it."""
    head = {"model": "kvroute-sim", "max_tokens": 4, "prompt": PROMPT}
    return json.dumps({**head, **after}).encode()


@pytest.fixture
def tokenizer(tmp_path: Path) -> str:
    return str(write_tiny_tokenizer(tmp_path).parent)


def scripted(tokenizer: str, mode: str = "ok") -> ScriptedWorker:
    return ScriptedWorker(mode, tokenizer=load_tokenizer(tokenizer).identity,
                          max_model_len=1_000_000)


@contextlib.asynccontextmanager
async def router(tokenizer: str, *workers: ScriptedWorker, limits: ConnectionLimits | None = None,
                 **kw: Any) -> AsyncIterator[tuple[UvicornServer, httpx.AsyncClient]]:
    """A router (``--tokenize match``) in front of ``workers``, all ready, and a client."""
    settings = RouterSettings(workers=tuple(w.url for w in workers), tokenizer=tokenizer,
                              health_interval=0.1, seed=3, **kw)
    async with UvicornServer(create_app(settings), limits=limits or ConnectionLimits()
                             ) as server, httpx.AsyncClient(base_url=server.url,
                                                            timeout=WAIT) as client:
        await eventually(lambda: client.get("/ready"), f"{len(workers)} workers ready",
                         until=lambda r: r.status_code == 200
                         and r.json()["workers"] == len(workers))
        yield server, client


async def total(client: httpx.AsyncClient, name: str, *needles: str) -> float:
    """The sum of ``name``'s samples whose labels hold every one of ``needles``."""
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(n in line for n in needles))


async def parts(body: bytes, cut: int, begun: ScriptedWorker) -> AsyncIterator[bytes]:
    """``body`` in two parts, the second only once ``begun`` has begun the request."""
    yield body[:cut]
    await asyncio.wait_for(begun.began.wait(), WAIT)
    yield body[cut:]


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_the_worker_receives_the_clients_bytes_while_they_still_arrive(
        tokenizer: str, declared: bool) -> None:
    body = body_bytes(temperature=0.5, stop=["\n"])
    headers = {"content-type": "application/json"}
    if declared:
        headers["content-length"] = str(len(body))
    async with scripted(tokenizer) as worker, router(tokenizer, worker) as (_, client):
        answer = await client.post("/v1/completions", content=parts(body, 20_000, worker),
                                   headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "ok"
    assert answer.headers["x-kvroute-worker"] == worker.url
    assert worker.bodies == [body]
    if declared:  # the client's framing is kept; a chunked upload stays chunked
        assert worker.headers[0]["Content-Length"] == str(len(body))
    else:
        assert worker.headers[0]["Transfer-Encoding"] == "chunked"


async def test_a_body_naming_its_model_after_the_prompt_is_sent_on_before_its_end(
        tokenizer: str) -> None:
    # OpenAI's SDKs write the prompt (or the messages) before the model: a router serving
    # one model decides on the body's first part all the same.
    body = json.dumps({"prompt": PROMPT, "model": "kvroute-sim", "max_tokens": 4}).encode()
    async with scripted(tokenizer) as worker, router(tokenizer, worker) as (_, client):
        answer = await client.post("/v1/completions", content=parts(body, 20_000, worker),
                                   headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text
    assert worker.bodies == [body]


async def test_a_stream_asked_for_after_the_prompt_is_relayed_as_a_stream(
        tokenizer: str) -> None:
    body = body_bytes(stream=True)
    async with scripted(tokenizer) as worker, router(tokenizer, worker) as (_, client):
        answer = await client.post("/v1/completions", content=parts(body, 20_000, worker),
                                   headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert sse_events(answer.content)[-1] == "[DONE]"
    assert worker.bodies == [body]


async def test_a_failover_before_the_first_byte_resends_the_body_from_its_start(
        tokenizer: str) -> None:
    body = body_bytes()
    async with scripted(tokenizer, "refuse_unread") as bad, scripted(tokenizer) as good:
        good.load_answer = DEEP_QUEUE  # the refusing worker is chosen first
        async with router(tokenizer, bad, good) as (_, client):
            # The rest of the body is sent only once the fallback began: the first worker
            # refused before the client had finished.
            answer = await client.post("/v1/completions", content=parts(body, 20_000, good),
                                       headers={"content-type": "application/json"})
            failures = await total(client, "kvroute_upstream_failures_total",
                                   'cause="status"', 'attempt="0"')
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-worker"] == good.url
    assert bad.began.is_set() and bad.bodies == []
    assert good.bodies == [body]
    assert failures == 1


async def _raw_upload(port: int, first: bytes, begun: ScriptedWorker, then: bytes | None
                      ) -> tuple[int, dict[str, str]]:
    """POST a chunked body by hand: ``first``, then (once ``begun`` began) ``then``, or
    nothing more when ``then`` is None; return the answer's status and headers (``0`` and
    none when the connection closed without one)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n" % (len(first), first))
        await writer.drain()
        await asyncio.wait_for(begun.began.wait(), WAIT)
        if then is not None:
            with contextlib.suppress(ConnectionError):
                writer.write(b"%x\r\n%s\r\n" % (len(then), then))
                await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    except asyncio.IncompleteReadError:
        return 0, {}
    finally:
        writer.close()
    status, *lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines if ": " in line)
    return int(status.split()[1]), {k.lower(): v for k, v in fields.items()}


async def test_a_body_passing_the_limit_after_it_began_upstream_is_a_413(
        tokenizer: str) -> None:
    body = body_bytes()
    async with scripted(tokenizer) as worker, router(
            tokenizer, worker, max_body_bytes=64 * 1024) as (server, client):
        status, headers = await _raw_upload(server.port, body[:20_000], worker,
                                            b" " * (64 * 1024))
        assert (status, headers["connection"]) == (413, "close")
        # the worker's request was cut off, never completed; the router serves on
        await eventually(lambda: worker.cancelled.is_set() or not worker.bodies,
                         "the worker's request ended")
        assert worker.bodies == []
        assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                ).status_code == 200


async def test_a_body_that_stops_after_it_began_upstream_is_a_408(tokenizer: str) -> None:
    limits = ConnectionLimits(body_idle_timeout=0.2)
    refusal = 'reason="body_idle_timeout"'
    async with scripted(tokenizer) as worker, router(tokenizer, worker, limits=limits) as (
            server, client):
        before = await metric(client, "kvroute_http_refusals_total", refusal)
        status, headers = await _raw_upload(server.port, body_bytes()[:20_000], worker, None)
        after = await metric(client, "kvroute_http_refusals_total", refusal)
    assert (status, headers["connection"]) == (408, "close")
    assert after == before + 1
    assert worker.bodies == []


async def test_a_client_leaving_after_its_body_began_upstream_ends_the_request(
        tokenizer: str) -> None:
    async with scripted(tokenizer) as worker, router(tokenizer, worker) as (server, client):
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        first = body_bytes()[:20_000]
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n" % (len(first), first))
        await writer.drain()
        await asyncio.wait_for(worker.began.wait(), WAIT)
        writer.close()
        await eventually(lambda: metric(client, "kvroute_client_disconnects_total",
                                        'stage="body"'), "the disconnect counted",
                         until=lambda n: n == 1)
        await eventually(lambda: total(client, "kvroute_requests_in_flight"),
                         "the booking released", until=lambda n: n == 0)
    assert worker.bodies == []
