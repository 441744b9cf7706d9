"""Probes of the router's HTTP surface against a real router on 127.0.0.1: bodies of every
wrong shape, hostile headers, wrong methods and paths, many and huge headers, a client that
sends its head a byte at a time. For every probe: an answer (never a dropped connection),
a 4xx for what the client got wrong (never a 5xx), and the router still serves the next good
request. Where the router forwards what its worker refuses (headers past the scripted
worker's own limits, a chat body it does not serve), the worker's 4xx is allowed."""

from __future__ import annotations

import asyncio
import json

import pytest

from httpapi.server import ConnectionLimits
from tests.router.http.test_app_boundary import BODY, router
from tests.support.servers import ScriptedWorker

JSON = {"content-type": "application/json"}


def raw(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


#: (method, path, body bytes, extra headers, the statuses allowed)
PROBES: dict[str, tuple[str, str, bytes, dict[str, str], set[int]]] = {
    "GET on completions": ("GET", "/v1/completions", b"", {}, {405}),
    "PUT on completions": ("PUT", "/v1/completions", json.dumps(BODY).encode(), JSON, {405}),
    "DELETE on chat": ("DELETE", "/v1/chat/completions", b"", {}, {405}),
    "a trailing slash": ("POST", "/v1/completions/", json.dumps(BODY).encode(), JSON,
                         {307, 404, 405}),  # the app's redirect to the exact path
    "a null body": ("POST", "/v1/completions", b"null", JSON, {400}),
    "an array body": ("POST", "/v1/completions", b"[]", JSON, {400}),
    "an empty body": ("POST", "/v1/completions", b"", JSON, {400}),
    "invalid UTF-8": ("POST", "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 1}',
                      JSON, {400}),
    "a lone surrogate in the prompt": ("POST", "/v1/completions",
                                       b'{"prompt": "a\\ud800b", "max_tokens": 1}', JSON,
                                       {200, 400}),
    "a lone surrogate in chat content": ("POST", "/v1/chat/completions", b'{"messages": '
                                         b'[{"role": "user", "content": "\\udfff"}]}', JSON,
                                         {200, 400}),
    "a lone surrogate in the model": ("POST", "/v1/completions",
                                      b'{"model": "\\ud800", "prompt": "x"}', JSON, {400, 404}),
    "a NaN temperature": ("POST", "/v1/completions",
                          b'{"prompt": "x", "temperature": NaN}', JSON, {400}),
    "max_tokens of -1": ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": -1}',
                         JSON, {400}),
    "max_tokens of 10**30": ("POST", "/v1/completions",
                             b'{"prompt": "x", "max_tokens": 1000000000000000000000000000000}',
                             JSON, {200, 400}),  # forwarded: the router books no output
    "a string stream": ("POST", "/v1/completions", b'{"prompt": "x", "stream": "yes"}', JSON,
                        {400}),
    "a number model": ("POST", "/v1/completions", b'{"prompt": "x", "model": 5}', JSON,
                       {400}),
    "negative token ids": ("POST", "/v1/completions", b'{"prompt": [-1, -2, -3]}', JSON,
                           {400}),
    "token ids past 2**64": ("POST", "/v1/completions",
                             b'{"prompt": [18446744073709551617]}', JSON, {200, 400}),
    "an empty messages list": ("POST", "/v1/chat/completions", b'{"messages": []}', JSON,
                               {400}),
    "a message without a role": ("POST", "/v1/chat/completions",
                                 b'{"messages": [{"content": "x"}]}', JSON, {400}),
    "10,000 content parts": ("POST", "/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 10_000}]}).encode(),
        JSON, {200, 400, 404}),  # 404: the scripted worker serves no chat
    "an unknown content part": ("POST", "/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": [{"type": "exploit", "x": 1}]}]}).encode(), JSON, {400}),
    "a priority of 1e400": ("POST", "/v1/completions", json.dumps(BODY).encode(),
                            {**JSON, "x-kvroute-priority": "1e400"}, {400}),
    "a priority of 10**5000": ("POST", "/v1/completions", json.dumps(BODY).encode(),
                               {**JSON, "x-kvroute-priority": "9" * 5000}, {400}),
    "a deadline of inf": ("POST", "/v1/completions", json.dumps(BODY).encode(),
                          {**JSON, "x-kvroute-ttft-deadline-ms": "inf"}, {400}),
    "a tenant of 32 KiB": ("POST", "/v1/completions", json.dumps(BODY).encode(),
                           {**JSON, "x-kvroute-tenant": "t" * 32768}, {200, 400}),
    "a latin-1 tenant": ("POST", "/v1/completions", json.dumps(BODY).encode(),
                         {**JSON, "x-kvroute-tenant": "caf\xe9"}, {200}),  # sent as bytes
    "2,000 headers": ("POST", "/v1/completions", json.dumps(BODY).encode(),
                      {**JSON, **{f"x-h{i}": "v" for i in range(2000)}}, {200, 400}),
    "a 100 KiB header": ("POST", "/v1/completions", json.dumps(BODY).encode(),
                         {**JSON, "x-big": "a" * 100_000}, {431}),
    "text/plain": ("POST", "/v1/completions", json.dumps(BODY).encode(),
                   {"content-type": "text/plain"}, {200, 415}),
    "a request id of 10 KiB": ("POST", "/v1/completions", json.dumps(BODY).encode(),
                               {**JSON, "x-request-id": "r" * 10_000}, {200}),
}


@pytest.mark.parametrize(("method", "path", "content", "headers", "allowed"), PROBES.values(),
                         ids=PROBES.keys())
async def test_http_probe(method: str, path: str, content: bytes, headers: dict[str, str],
                          allowed: set[int]) -> None:
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        sent = {k: v.encode("latin-1") for k, v in headers.items()}  # as a client's bytes
        answer = await client.request(method, path, content=content, headers=sent)
        assert answer.status_code in allowed, (answer.status_code, answer.text[:300])
        if answer.status_code >= 400 and "x-kvroute-worker" not in answer.headers:
            # the router's own refusal: an OpenAI error body
            assert "error" in answer.json() or answer.status_code in (404, 405)
        after = await client.post("/v1/completions", json=BODY)
        assert after.status_code == 200


async def test_a_head_sent_a_byte_at_a_time_is_closed_at_the_header_timeout() -> None:
    limits = ConnectionLimits(header_timeout=0.3)
    async with ScriptedWorker() as worker, router(worker, limits=limits) as (server, client):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        closed = False
        try:
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
                writer.write(bytes([byte]))
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1), 0.02) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
        except ConnectionError:
            closed = True
        finally:
            writer.close()
        assert closed
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200


def test_the_probe_list_is_long_enough() -> None:
    assert len(PROBES) >= 30

