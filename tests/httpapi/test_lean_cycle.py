"""The raw routes served by the connection's protocol (:mod:`httpapi.lean_cycle`,
:mod:`httpapi.server` rule 7), against uvicorn's own cycle (``KVROUTE_LEAN_HTTP=0``): the same
answers, byte for byte less the date and the request id, on a real server over real sockets:
keep-alive, pipelining, chunked bodies, a 100-continue, malformed and oversized requests, slow
bodies, a route that fails, and a client that leaves mid-answer."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httptools
import pytest
from starlette.types import Receive, Scope, Send

from httpapi.app import new_app
from httpapi.body import receive_body
from httpapi.lean_cycle import DEPARTURE, LeanCycle
from httpapi.refusals import refusals
from httpapi.server import LEAN_ENV, ConnectionLimits
from tests.httpapi.test_app import FakeState
from tests.support.eventually import eventually
from tests.support.servers import UvicornServer


class Echo:
    """Echoes its body, and says in ``x-lean`` whether the server's cycle served it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await receive_body(None, receive, 1024)
        if body == b"fail":
            raise RuntimeError("the route failed")
        lean = b"1" if DEPARTURE in scope else b"0"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode()),
                                (b"x-lean", lean)]})
        await send({"type": "http.response.body", "body": body})


class Stream:
    """Streams chunks until the client leaves, noticed as each cycle lets a route notice it."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive_body(None, receive, 1024)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        departure = scope.get(DEPARTURE)
        gone = (departure() if departure is not None
                else asyncio.ensure_future(_disconnect(receive)))
        try:
            for _ in range(10_000):
                await send({"type": "http.response.body", "body": b"data: x\n\n",
                            "more_body": True})
                if gone.done():
                    self.left.set()
                    return
                await asyncio.sleep(0.01)
        finally:
            gone.cancel()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass
class Answer:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


class _Answers:
    """httptools' response parser callbacks: the answers read so far."""

    def __init__(self) -> None:
        self.done: list[Answer] = []
        self.current = Answer()
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.current.body += body

    def on_message_complete(self) -> None:
        self.done.append(self.current)
        self.current = Answer()


async def exchange(url: str, raw: bytes, answers: int) -> tuple[list[Answer], bool]:
    """Write ``raw`` on one connection; return the first ``answers`` answers and whether the
    server closed the connection after them."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    parsed = _Answers()
    try:
        writer.write(raw)
        async with asyncio.timeout(10):
            while len(parsed.done) < answers:
                data = await reader.read(65536)
                if not data:
                    break
                parsed.parser.feed_data(data)
            closed = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.3):
                    closed = await reader.read(1) == b""
    finally:
        writer.close()
    return parsed.done, closed


def post(body: bytes, path: str = "/raw", extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: test\r\ncontent-length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), extra, body))


@contextlib.asynccontextmanager
async def serving(lean: bool, monkeypatch: pytest.MonkeyPatch,
                  limits: ConnectionLimits | None = None, stream: Stream | None = None
                  ) -> AsyncIterator[str]:
    monkeypatch.setenv(LEAN_ENV, "1" if lean else "0")
    app = new_app("test", FakeState(), {"/raw": Echo(), "/stream": stream or Stream()})
    async with UvicornServer(app, limits=limits or ConnectionLimits()) as server:
        yield server.url


def _same_shape(a: Answer) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """An answer less what differs between two servers: the date, the request id, and which
    cycle served it."""
    kept = [(k, v) for k, v in a.headers if k not in (b"date", b"x-request-id", b"x-lean")]
    return a.status, kept, a.body


async def test_both_cycles_answer_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = []
    for lean in (True, False):
        async with serving(lean, monkeypatch) as url:
            answers, closings = [], []
            for raw in (post(b"hello"), post(b"x" * 2000), post(b"fail"),
                        post(b"via the app", "/raw?q=1")):
                answer, closed = await exchange(url, raw, 1)
                answers += answer
                closings.append(closed)
        assert [dict(a.headers).get(b"x-lean") for a in (answers[0], answers[3])] == [
            b"1" if lean else b"0", b"0"]  # a query string goes through the app
        assert all(dict(a.headers)[b"x-request-id"] for a in answers[:2])
        shapes.append(([_same_shape(a) for a in answers], closings))
    assert shapes[0] == shapes[1]
    statuses = [s[0] for s in shapes[0][0]]
    assert statuses == [200, 413, 500, 200]
    assert shapes[0][0][0][2] == b"hello"
    assert shapes[0][1] == [False, True, True, False]  # a 413 and a 500 close the connection


@pytest.mark.parametrize("lean", [True, False])
async def test_keep_alive_and_pipelined_requests_are_answered_in_order(
        lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(lean, monkeypatch) as url:
        raw = (post(b"one") + b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n" + post(b"two")
               + post(b"three", extra=b"x-request-id: mine-7\r\n"))
        answers, closed = await exchange(url, raw, 4)
    assert [a.body for a in answers] == [b"one", b'{"status":"ok"}', b"two", b"three"]
    assert dict(answers[3].headers)[b"x-request-id"] == b"mine-7"
    assert not closed  # kept alive
    ids = [dict(a.headers)[b"x-request-id"] for a in answers]
    assert len(set(ids)) == 4


@pytest.mark.parametrize("lean", [True, False])
async def test_a_chunked_body_and_a_100_continue_are_read_whole(
        lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(lean, monkeypatch) as url:
        chunked = (b"POST /raw HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\n"
                   b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        answers, _ = await exchange(url, chunked, 1)
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"POST /raw HTTP/1.1\r\nhost: test\r\ncontent-length: 4\r\n"
                         b"expect: 100-continue\r\n\r\n")
            async with asyncio.timeout(10):
                interim = await reader.readuntil(b"\r\n\r\n")
                writer.write(b"body")
                final = await reader.readuntil(b"body")
        finally:
            writer.close()
    assert [(a.status, a.body) for a in answers] == [(200, b"hello world")]
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert final.startswith(b"HTTP/1.1 200 OK\r\n")


@pytest.mark.parametrize("lean", [True, False])
async def test_a_malformed_request_is_answered_400_and_closed(
        lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(lean, monkeypatch) as url:
        answers, closed = await exchange(
            url, b"POST /raw HTTP/1.1\r\nhost: test\r\ncontent-length: 1x\r\n\r\n", 1)
    assert [a.status for a in answers] == [400]
    assert closed


@pytest.mark.parametrize("lean", [True, False])
async def test_a_body_that_pauses_is_answered_408_and_counted(
        lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    limits = ConnectionLimits(body_idle_timeout=0.2)
    before = refusals("body_idle_timeout")
    async with serving(lean, monkeypatch, limits) as url:
        answers, closed = await exchange(url, post(b"0123456789")[:-5], 1)
    assert [a.status for a in answers] == [408]
    assert b"paused for over 0.2 s" in answers[0].body
    assert closed
    assert refusals("body_idle_timeout") == before + 1


@pytest.mark.parametrize("lean", [True, False])
async def test_a_client_that_leaves_mid_stream_is_noticed(
        lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Stream()
    async with serving(lean, monkeypatch, stream=stream) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(post(b"go", "/stream"))
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"data: x\n\n")
        writer.close()
        await eventually(stream.left.is_set, "the route to notice the client left")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked" in head


class Slow:
    """Streams ``chunks`` chunks, one every ``pause`` seconds."""

    def __init__(self, chunks: int, pause: float) -> None:
        self.chunks, self.pause = chunks, pause

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive_body(None, receive, 1024)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(self.chunks):
            await asyncio.sleep(self.pause)
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b""})


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    parsed: _Answers, raw: bytes, closed_while: str) -> None:
    """Send ``raw`` on the connection and read until one more answer has ended; the server
    closing the connection first fails with ``closed_while``."""
    writer.write(raw)
    wanted = len(parsed.done) + 1
    while len(parsed.done) < wanted:
        data = await reader.read(65536)
        assert data, f"the server closed a connection {closed_while}"
        parsed.parser.feed_data(data)


@pytest.mark.parametrize("lean", [True, False])
async def test_keep_alive_closes_an_idle_connection_never_a_busy_one(
        lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEAN_ENV, "1" if lean else "0")
    app = new_app("test", FakeState(), {"/raw": Echo(), "/slow": Slow(15, 0.1)})
    limits = ConnectionLimits(keep_alive_timeout=0.5)
    async with UvicornServer(app, limits=limits) as server:
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        parsed = _Answers()
        try:
            async with asyncio.timeout(20):
                for raw in (post(b"one"), post(b"", "/slow"), post(b"three")):
                    # the keep-alive timer runs from each answer's end
                    await _exchange(reader, writer, parsed, raw, "it was still answering")
                assert await reader.read(1) == b""  # then idle past the timeout: closed
        finally:
            writer.close()
    assert [a.body for a in parsed.done] == [b"one", b"x" * 15, b"three"]


@pytest.mark.parametrize("lean", [True, False])
async def test_a_connection_busy_past_the_keep_alive_timeout_stays_open(
        lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The idle deadline moves on at each answer's end: the shared timer fires mid-sequence,
    # finds no deadline passed, and waits for the next.
    monkeypatch.setenv(LEAN_ENV, "1" if lean else "0")
    app = new_app("test", FakeState(), {"/raw": Echo()})
    limits = ConnectionLimits(keep_alive_timeout=0.3)
    async with UvicornServer(app, limits=limits) as server:
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        parsed = _Answers()
        try:
            async with asyncio.timeout(20):
                for i in range(12):  # 1.2 s of requests, 0.1 s apart
                    await _exchange(reader, writer, parsed, post(b"%d" % i), "that was not idle")
                    await asyncio.sleep(0.1)
                assert await reader.read(1) == b""  # then idle past the timeout: closed
        finally:
            writer.close()
    assert [a.body for a in parsed.done] == [b"%d" % i for i in range(12)]


async def test_a_slow_head_after_an_answer_is_closed_at_the_header_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The head's deadline, shorter than the idle one the answer set, moves the shared timer
    # earlier.
    monkeypatch.setenv(LEAN_ENV, "1")
    app = new_app("test", FakeState(), {"/raw": Echo()})
    limits = ConnectionLimits(keep_alive_timeout=30, header_timeout=0.3)
    async with UvicornServer(app, limits=limits) as server:
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        parsed = _Answers()
        try:
            # Closed at the header's 0.3 s, not the answer's 30 s of keep-alive (the guard's
            # 10 s falls between them).
            async with asyncio.timeout(10):
                await _exchange(reader, writer, parsed, post(b"one"), "before its answer")
                writer.write(b"POST /raw HTTP/1.1\r\nHost: x\r\n")  # and no more
                assert await reader.read(1) == b""
        finally:
            writer.close()
    assert [a.body for a in parsed.done] == [b"one"]


async def test_a_finished_request_leaves_the_servers_tasks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Each request's task leaves the server's set as its cycle ends (no done callback), so
    # a graceful shutdown, which waits for the set to empty, is not held up; pipelined
    # requests go through uvicorn's start, which adds its own.
    monkeypatch.setenv(LEAN_ENV, "1")
    app = new_app("test", FakeState(), {"/raw": Echo()})
    async with UvicornServer(app) as server:
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        parsed = _Answers()
        try:
            async with asyncio.timeout(10):
                for batch in ([post(b"one")], [post(b"two"), post(b"three")]):
                    writer.write(b"".join(batch))
                    wanted = len(parsed.done) + len(batch)
                    while len(parsed.done) < wanted:
                        parsed.parser.feed_data(await reader.read(65536))
                await eventually(lambda: not server.server.server_state.tasks,
                                 "the request tasks to leave the server's set")
        finally:
            writer.close()
    assert [a.body for a in parsed.done] == [b"one", b"two", b"three"]


async def test_a_finished_request_leaves_nothing_for_the_cyclic_collector(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A cycle in a reference cycle kept each request's objects until a collection, which
    # under load cost several µs a request; freed by reference counting, nothing waits.
    async with serving(True, monkeypatch) as url:
        gc.collect()
        gc.disable()
        try:
            answers, _ = await exchange(url, post(b"a") * 5, 5)
            assert [a.status for a in answers] == [200] * 5
            await asyncio.sleep(0.05)  # the last handler's task ends
            left = [o for o in gc.get_objects() if type(o) is LeanCycle]  # no __class__ read
        finally:
            gc.enable()
    assert len(left) <= 1, f"{len(left)} finished cycles held in reference cycles"
