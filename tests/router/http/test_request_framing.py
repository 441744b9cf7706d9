"""Request smuggling at the router's raw routes, against a real router on 127.0.0.1 spoken to
by hand over a socket, in front of a worker that records every byte it receives.

A request whose framing two HTTP readers could take differently (``Content-Length`` with
``Transfer-Encoding``, two lengths that differ, a length that is not a plain decimal number, a
transfer coding other than ``chunked``, a malformed chunk) is refused with a 4xx and its
connection closed, and nothing of it reaches the worker. A request that is taken reaches the
worker framed as the router read it: one framing header, the router's own, the client's body
bytes exactly, and no byte the client sent after it (a pipelined request is a request of its
own, never part of the first one's body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator

import httpx
import pytest

from httpapi.server import ConnectionLimits
from router.http.app import create_app
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.recording_upstream import RecordingUpstream
from tests.support.servers import UvicornServer

BODY = json.dumps({"model": "kvroute-sim", "prompt": "framing " * 8, "max_tokens": 2}
                  ).encode()
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
#: Sent after the requests under test: answered last, after which the router closes the
#: connection, so an exchange ends at that close rather than at a silence.
CLOSING = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
N = len(BODY)


@contextlib.asynccontextmanager
async def router() -> AsyncIterator[tuple[int, RecordingUpstream]]:
    async with RecordingUpstream() as upstream:
        settings = RouterSettings(workers=(upstream.url,), health_interval=0.1, seed=3)
        async with UvicornServer(create_app(settings), limits=ConnectionLimits()) as server, \
                httpx.AsyncClient(base_url=server.url) as client:
            await eventually(lambda: client.get("/ready"), "the worker ready",
                             until=lambda r: r.status_code == 200)
            yield server.port, upstream


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw`` then :data:`CLOSING` on a fresh connection and return all the server
    sends until it closes (or 2 s pass with nothing more)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw + CLOSING)
        await writer.drain()
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while True:
                piece = await asyncio.wait_for(reader.read(65536), 2.0)
                if not piece:
                    break
                got += piece
        return got
    finally:
        writer.close()


def head(*headers: str) -> bytes:
    return ("POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + "".join(f"{h}\r\n" for h in headers) + "\r\n").encode()


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def statuses(answer: bytes) -> list[int]:
    """The status of each answer in ``answer`` (answers to pipelined requests follow each
    other's bodies)."""
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]


#: Requests two readers could frame differently: each refused, none of it sent upstream.
AMBIGUOUS = {
    "length and chunked": head(f"Content-Length: {N}", "Transfer-Encoding: chunked")
    + chunked(BODY),
    "chunked and length": head("Transfer-Encoding: chunked", f"Content-Length: {N}")
    + chunked(BODY),
    "two lengths": head(f"Content-Length: {N}", f"Content-Length: {N + 5}") + BODY + b"x" * 5,
    "a list of lengths": head(f"Content-Length: {N}, {N + 5}") + BODY + b"x" * 5,
    "a length not a number": head("Content-Length: abc") + BODY,
    "a negative length": head("Content-Length: -1") + BODY,
    "a signed length": head(f"Content-Length: +{N}") + BODY,
    "a hexadecimal length": head(f"Content-Length: 0x{N:x}") + BODY,
    "a length past 2**64": head(f"Content-Length: {2**64 + N}") + BODY,
    "gzip": head("Transfer-Encoding: gzip") + BODY,
    "gzip then chunked": head("Transfer-Encoding: gzip, chunked") + chunked(BODY),
    "chunked then gzip": head("Transfer-Encoding: chunked, gzip") + chunked(BODY),
    "chunked twice": head("Transfer-Encoding: chunked", "Transfer-Encoding: chunked")
    + chunked(BODY),
    "identity": head("Transfer-Encoding: identity") + BODY,
    "a misspelt chunked": head("Transfer-Encoding: xchunked") + chunked(BODY),
    "a space before the colon": head(f"Content-Length : {N}") + BODY,
    "a folded header": head("Transfer-Encoding:", " chunked") + chunked(BODY),
    "a chunk size not hex": head("Transfer-Encoding: chunked") + b"zz\r\n" + BODY
    + b"\r\n0\r\n\r\n",
    "a chunk size past 2**64": head("Transfer-Encoding: chunked")
    + b"1%016x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n",
    "a bare LF in the head": head().replace(b"Host: test\r\n", b"Host: test\nX-A: b\r\n")
    + b"",
}


@pytest.mark.parametrize("raw", AMBIGUOUS.values(), ids=AMBIGUOUS.keys())
async def test_ambiguous_framing_is_refused_and_nothing_reaches_the_worker(raw: bytes) -> None:
    async with router() as (port, upstream):
        answer = await exchange(port, raw + SMUGGLED)
    codes = statuses(answer)
    assert codes and 400 <= codes[0] < 500 and codes[0] != 404, answer[:300]
    assert len(codes) == 1, f"a request after a refused one was served: {answer!r}"
    assert upstream.completions == []


#: Requests that are taken: each reaches the worker framed as the router read it.
TAKEN = {
    "a length": head(f"Content-Length: {N}") + BODY,
    "chunked": head("Transfer-Encoding: chunked") + chunked(BODY),
    "chunked in capitals": head("Transfer-Encoding: CHUNKED") + chunked(BODY),
    "chunked in small chunks": head("Transfer-Encoding: chunked")
    + b"".join(b"%x\r\n%s\r\n" % (len(BODY[i:i + 7]), BODY[i:i + 7])
               for i in range(0, N, 7)) + b"0\r\n\r\n",
    "chunked with an extension and a trailer": head("Transfer-Encoding: chunked")
    + b"%x;name=value\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (N, BODY),
}


@pytest.mark.parametrize("raw", TAKEN.values(), ids=TAKEN.keys())
async def test_a_request_taken_reaches_the_worker_framed_as_read(raw: bytes) -> None:
    async with router() as (port, upstream):
        answer = await exchange(port, raw + SMUGGLED)
    # the completion, /v1/models, then CLOSING's /health
    assert statuses(answer) == [200, 200, 200], answer[:400]
    (sent,) = upstream.completions
    assert upstream.protocol_errors == []
    assert sent.complete and sent.body == BODY
    framing = sent.header(b"content-length") + sent.header(b"transfer-encoding")
    assert len(framing) == 1, sent.headers
    if sent.header(b"content-length"):
        assert sent.header(b"content-length") == [str(N).encode()]
    assert not sent.header(b"x-trailer")
    assert all(b"/v1/models" not in c for c in upstream.connections)


async def test_headers_are_forwarded_one_per_line_as_received() -> None:
    # Names and values the router forwards are the client's, unchanged; none can add a line.
    raw = head(f"Content-Length: {N}", "X-Note: a, b;c=\"d\"", "X-Empty:") + BODY
    async with router() as (port, upstream):
        answer = await exchange(port, raw)
    assert statuses(answer) == [200, 200]  # and CLOSING's
    (sent,) = upstream.completions
    assert sent.header(b"x-note") == [b'a, b;c="d"']
    assert upstream.protocol_errors == []


async def test_headers_the_connection_header_names_are_not_forwarded() -> None:
    # RFC 9110 7.6.1: the fields Connection names are for this hop only.
    raw = head(f"Content-Length: {N}", "Connection: keep-alive, X-Hop, x-kvroute-note",
               "X-Hop: 1", "X-Kvroute-Note: 2", "X-Kept: 3") + BODY
    async with router() as (port, upstream):
        answer = await exchange(port, raw)
    assert statuses(answer) == [200, 200]  # and CLOSING's
    (sent,) = upstream.completions
    assert sent.header(b"x-hop") == [] and sent.header(b"x-kvroute-note") == []
    assert sent.header(b"x-kept") == [b"3"]
