"""The proxy's HTTP/1.1 client against a raw server on 127.0.0.1 that answers exactly the bytes
a test gives it: connections kept and reused (and dropped when idle, closed or refused for
reuse), answers split across reads, chunked and close-delimited bodies, answers that do not
parse, the connection limit, request bodies sent as they arrive, and the same under uvloop
(the loop the router serves on)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest
import uvloop

from router.http.proxy import Proxy, UpstreamUnavailable
from router.http.upstream import ConnectionPool
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker

BODY = b'{"prompt": "hello"}'
ANSWER = b'{"ok":true}'
OK = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"
      + ANSWER)


class RawServer:
    """Answers each request it reads with ``answer(n)`` (n: the request's number, from 0),
    written in the pieces given (``None``: the connection is closed instead); counts
    connections and keeps what each request sent."""

    def __init__(self, answer: Callable[[int], list[bytes] | None], close_after: bool = False
                 ) -> None:
        self.answer = answer
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append(head + await reader.readexactly(length))
                pieces = self.answer(len(self.requests) - 1)
                if pieces is None:  # hang up unanswered, as a keep-alive timer firing
                    break
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)  # each piece its own read on the other side
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


async def test_sequential_requests_reuse_one_connection(proxy: Proxy) -> None:
    async with RawServer(lambda n: [OK]) as server:
        for _ in range(3):
            answer = await proxy.send(f"{server.url}/v1/completions", BODY,
                                      {"X-Client": "a", "Connection": "keep-alive"})
            assert answer.status == 200 and await answer.read() == ANSWER
        assert server.connections == 1
    head = server.requests[0].split(b"\r\n")
    assert head[0] == b"POST /v1/completions HTTP/1.1"
    assert b"X-Client: a" in head and b"content-length: %d" % len(BODY) in head
    assert not any(line.lower().startswith(b"connection:") for line in head)
    assert server.requests[0].endswith(b"\r\n\r\n" + BODY)


async def test_an_answer_split_across_reads_is_put_together(proxy: Proxy) -> None:
    pieces = [OK[:9], OK[9:30], OK[30:-5], OK[-5:]]
    async with RawServer(lambda n: pieces) as server:
        answer = await proxy.send(f"{server.url}/v1/completions", BODY, {})
        assert answer.headers == {"Content-Type": "application/json"}
        assert await answer.read() == ANSWER


async def test_a_chunked_stream_is_decoded_chunk_by_chunk(proxy: Proxy) -> None:
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(3)] + [b"data: [DONE]\n\n"]
    chunked = [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    async with RawServer(lambda n: [head, *chunked]) as server:
        for _ in range(2):
            answer = await proxy.send(f"{server.url}/v1/completions", BODY, {}, stream=True)
            assert answer.first_chunk == events[0]
            assert [c async for c in answer.stream()] == events
        assert server.connections == 1  # a stream read to its end leaves the connection


async def test_a_body_that_ends_with_the_connection_is_read_whole(proxy: Proxy) -> None:
    answer_bytes = [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n", b'{"a":', b"1}"]
    async with RawServer(lambda n: answer_bytes, close_after=True) as server:
        for _ in range(2):
            answer = await proxy.send(f"{server.url}/v1/completions", BODY, {})
            assert await answer.read() == b'{"a":1}'
        assert server.connections == 2


async def test_connection_close_is_not_reused(proxy: Proxy) -> None:
    closing = OK.replace(b"Content-Length", b"Connection: close\r\nContent-Length")
    async with RawServer(lambda n: [closing], close_after=True) as server:
        for _ in range(2):
            answer = await proxy.send(f"{server.url}/v1/completions", BODY, {})
            assert await answer.read() == ANSWER
        assert server.connections == 2


async def test_a_connection_the_worker_closed_while_idle_is_not_used(proxy: Proxy) -> None:
    async with RawServer(lambda n: [OK], close_after=True) as server:
        answer = await proxy.send(f"{server.url}/v1/completions", BODY, {})
        await answer.read()
        pool = proxy._pool
        assert pool is not None
        await eventually(lambda: len(pool) == 0, "the closed connection forgotten")
        answer = await proxy.send(f"{server.url}/v1/completions", BODY, {})
        assert await answer.read() == ANSWER
        assert server.connections == 2


async def test_a_kept_connection_closed_as_it_is_reused_is_retried_on_a_new_one(
        proxy: Proxy) -> None:
    async with RawServer(lambda n: None if n == 1 else [OK]) as server:
        for _ in range(2):
            answer = await proxy.send(f"{server.url}/v1/completions", BODY, {})
            assert answer.status == 200 and await answer.read() == ANSWER
        assert server.connections == 2 and len(server.requests) == 3
        assert server.requests[1] == server.requests[2]  # the same request, sent again


async def test_a_new_connection_closed_unanswered_is_not_retried(proxy: Proxy) -> None:
    async with RawServer(lambda n: None) as server:
        with pytest.raises(UpstreamUnavailable, match="closed the connection") as failed:
            await proxy.send(f"{server.url}/v1/completions", BODY, {})
        assert failed.value.cause == "connect" and server.connections == 1


@pytest.mark.parametrize("garbage", [b"NOT HTTP AT ALL\r\n\r\n", b"HTTP/1.1 2x0 OK\r\n\r\n"])
async def test_an_answer_that_does_not_parse_is_retryable(proxy: Proxy, garbage: bytes) -> None:
    async with RawServer(lambda n: [garbage]) as server:
        with pytest.raises(UpstreamUnavailable) as failed:
            await proxy.send(f"{server.url}/v1/completions", BODY, {})
    assert failed.value.cause == "connect" and "does not parse" in str(failed.value)


async def test_a_connection_lost_mid_body_fails_the_read(proxy: Proxy) -> None:
    cut = OK.replace(b"Content-Length: 11", b"Content-Length: 99")
    async with RawServer(lambda n: [cut], close_after=True) as server:
        answer = await proxy.send(f"{server.url}/v1/completions", BODY, {})
        with pytest.raises(UpstreamUnavailable, match="closed the connection"):
            await answer.read()


async def test_an_ended_answer_read_without_a_coroutine_is_the_same_body() -> None:
    # ended_body is body() for an answer that ended: the same bytes, whatever the pieces.
    pool = ConnectionPool(8, idle_keepalive=4.0)
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"4\r\n{\"ok\r\n7\r\n\":true}\r\n0\r\n\r\n")
    for pieces in ([OK], [OK[:40], OK[40:-3], OK[-3:]], [chunked], [chunked[:50], chunked[50:]]):
        async with RawServer(lambda n, pieces=pieces: pieces) as server:
            host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
            read = []
            for ended in (False, True):
                exchange = await pool.acquire(host, port)
                exchange.send(b"POST / HTTP/1.1\r\ncontent-length: 2\r\n\r\n", b"{}")
                await eventually(lambda exchange=exchange: exchange.complete, "the answer's end")
                read.append(exchange.ended_body() if ended else await exchange.body())
                exchange.release()
        assert read == [ANSWER, ANSWER]
    pool.close()


async def test_an_idle_connection_past_its_keepalive_is_dropped() -> None:
    now = [0.0]
    pool = ConnectionPool(8, idle_keepalive=4.0, clock=lambda: now[0])
    async with RawServer(lambda n: [OK]) as server:
        host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
        for wait in (3.9, 4.1):
            exchange = await pool.acquire(host, port)
            exchange.send(b"POST / HTTP/1.1\r\ncontent-length: 2\r\n\r\n", b"{}")
            assert await exchange.body() == ANSWER
            exchange.release()
            now[0] += wait
        first_two = server.connections
        exchange = await pool.acquire(host, port)  # idle 4.1 s: a new connection
        exchange.close()
        await eventually(lambda: server.connections == 2, "a second connection")
    assert first_two == 1 and len(pool) == 0


async def test_a_full_pool_waits_for_a_free_connection() -> None:
    pool = ConnectionPool(1, idle_keepalive=4.0)
    async with RawServer(lambda n: [OK]) as server:
        host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
        first = await pool.acquire(host, port)
        second = asyncio.create_task(pool.acquire(host, port))
        await asyncio.sleep(0.05)
        assert not second.done()  # one connection at most: it waits
        first.close()
        exchange = await asyncio.wait_for(second, 10)
        assert exchange is not first and len(pool) == 1
        exchange.close()


def test_the_client_works_under_uvloop() -> None:
    async def scenario() -> tuple[int, list[bytes]]:
        p = Proxy()
        await p.start()
        try:
            async with RawServer(lambda n: [OK]) as server:
                bodies = []
                for _ in range(3):
                    answer = await p.send(f"{server.url}/v1/completions", BODY, {})
                    bodies.append(await answer.read())
                return server.connections, bodies
        finally:
            await p.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        connections, bodies = runner.run(scenario())
    assert connections == 1 and bodies == [ANSWER] * 3
    assert json.loads(bodies[0]) == {"ok": True}


async def _pieces(body: bytes, fail: Exception | None = None) -> AsyncIterator[bytes]:
    for i in range(0, len(body), 7):
        await asyncio.sleep(0)  # each piece as if it had just arrived
        yield body[i:i + 7]
    if fail is not None:
        raise fail


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_still_arriving_is_sent_as_it_arrives(proxy: Proxy, declared: bool
                                                           ) -> None:
    body = json.dumps({"model": "kvroute-sim", "prompt": "hello " * 50,
                       "max_tokens": 4}).encode()
    async with ScriptedWorker() as worker:
        answer = await proxy.send(f"{worker.url}/v1/completions", _pieces(body), {},
                                  length=len(body) if declared else None)
        assert answer.status == 200
        assert json.loads(await answer.read())["choices"][0]["text"] == "ok"
    assert worker.requests == [json.loads(body)]  # with its length, or chunked


async def test_a_body_that_fails_while_sent_raises_its_error(proxy: Proxy) -> None:
    class Gone(Exception):
        pass

    async with ScriptedWorker() as worker:
        with pytest.raises(Gone):
            await proxy.send(f"{worker.url}/v1/completions", _pieces(b'{"prompt": "x', Gone()),
                             {})
        pool = proxy._pool
        assert pool is not None
        await eventually(lambda: len(pool) == 0, "the broken connection closed")


async def test_an_interim_answer_is_skipped_and_expect_not_forwarded(proxy: Proxy) -> None:
    async with RawServer(lambda n: [b"HTTP/1.1 100 Continue\r\n\r\n", OK]) as server:
        for _ in range(2):
            answer = await proxy.send(f"{server.url}/v1/completions", BODY,
                                      {"Expect": "100-continue"})
            assert answer.status == 200 and await answer.read() == ANSWER
        assert server.connections == 1
    assert not any(b"expect" in r.lower() for r in server.requests)
