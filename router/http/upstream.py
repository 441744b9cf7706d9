"""The proxy's HTTP/1.1 client: kept-alive connections to the workers, one exchange at a
time on each, parsed with httptools (the C parser uvicorn serves with).

An :class:`Exchange` is one connection's protocol; :class:`ConnectionPool` hands out idle
ones per ``host:port`` (most recently used first) and opens new ones, at most
``max_connections`` in all. A request is one write of its head and body (a body still
arriving is written as it comes, from a task of its own, under its length or in the chunked
coding); the answer's status and headers are awaited (an interim ``100 Continue`` skipped),
then its body is read whole or chunk by chunk, as it arrives (the parser decodes the chunked
coding). An exchange whose answer was read to its end goes back to the pool when both sides
keep the connection alive, and is dropped when it was idle for ``idle_keepalive`` seconds or
the worker closed it meanwhile; every other one is closed. No timers run per request: the
caller's deadlines bound every wait (:mod:`router.http.proxy`).

Errors: a connection that fails (refused, reset, closed before the answer ended, or an answer
that does not parse) raises :class:`ConnectionError` from the wait it breaks; the proxy
translates it. A stream read more slowly than it arrives pauses reading from the worker past
``HIGH_WATER`` buffered bytes.

Why not aiohttp's client: in a router process on one core forwarding a 1,000-byte completion
to nginx, aiohttp's ``ClientSession`` cost about a quarter of the router's CPU (its request
and response objects, header multidicts, per-request timer handles); this client, with the
same parser in C, measured as ``bench/router.py``'s docstring says.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import time
from collections.abc import AsyncIterable, Callable
from typing import cast

import httptools

from router.http.resolver import Resolver

__all__ = ["HIGH_WATER", "ConnectionPool", "Exchange"]

#: Buffered answer bytes past which reading from the worker pauses (a slow reader).
HIGH_WATER = 256 * 1024


class Exchange(asyncio.Protocol):
    """One connection to a worker and the exchange on it (module docstring)."""

    def __init__(self, pool: ConnectionPool, key: tuple[str, int]) -> None:
        self._pool = pool
        self.key = key
        # Made on the loop it serves (the pool opens it there): each wait's future comes
        # from it without asking for the running loop (a system call per ask, for its pid).
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        #: Whether the answer's head arrived, and whether its body ended.
        self.head_done = False
        self.complete = False
        self._ends_at_close = False
        self._keep_alive = False
        self._interim = False
        self.error: Exception | None = None
        self.closed = False
        self.idle_since = 0.0
        #: The task writing a body sent as it arrives, while it runs.
        self._writer: asyncio.Task[None] | None = None
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they are ones.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)
            self._drained = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"the worker's answer does not parse: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.lost(self)
        self.resume_writing()
        if self.head_done and self._ends_at_close and not self.complete:
            self.on_message_complete()  # a body delimited by the connection's end
        elif not self.complete:
            self._fail(exc if isinstance(exc, ConnectionError) else ConnectionError(
                "the worker closed the connection" + (f": {exc}" if exc else "")))

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self._interim = True
            self.headers = []
            return
        self.status = status
        self.head_done = True
        # Read here: once the message completes, the parser no longer says.
        self._keep_alive = self._parser.should_keep_alive()
        ends_at_close = True
        for name, _ in self.headers:
            name = name.lower()
            if name == b"content-length" or name == b"transfer-encoding":
                ends_at_close = False
                break
        self._ends_at_close = ends_at_close
        self._wake_head()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake_body()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self._wake_head()
        self._wake_body()

    # -- the exchange

    def send(self, head: bytes, body: bytes) -> None:
        """Write a request: its head (request line and headers, with the blank line) and
        body."""
        assert self.transport is not None, "send() on an unconnected exchange"
        if len(body) < 16384:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    def send_streamed(self, head: bytes, chunks: AsyncIterable[bytes], chunked: bool) -> None:
        """Write a request whose body arrives as ``chunks`` (framed with the chunked coding
        when ``chunked``, else under the length the head declares), from a task of its own,
        so that an answer that begins before the body ends is read meanwhile. A failure of
        ``chunks`` fails the exchange with that error."""
        assert self.transport is not None, "send_streamed() on an unconnected exchange"
        self.transport.write(head)
        self._writer = asyncio.get_running_loop().create_task(self._write(chunks, chunked))

    async def _write(self, chunks: AsyncIterable[bytes], chunked: bool) -> None:
        try:
            async for chunk in chunks:
                if self.closed:
                    raise ConnectionError("the worker closed the connection")
                if chunk:
                    assert self.transport is not None
                    self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked
                                         else chunk)
                if self._drained is not None:
                    await self._drained
            if chunked and not self.closed:
                assert self.transport is not None
                self.transport.write(b"0\r\n\r\n")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to whoever waits on the answer
            self._fail(exc)
            self.close()
        finally:
            self._writer = None

    async def head(self) -> None:
        """Wait for the answer's status and headers.

        Raises:
            ConnectionError: the connection failed first.
        """
        if not self.head_done and self.error is None:
            self._head = self._loop.create_future()
            try:
                await self._head
            finally:
                self._head = None
        if self.error is not None and not self.head_done:
            raise self.error

    async def chunk(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some; ``b""`` once
        the body ended.

        Raises:
            ConnectionError: the connection failed before the body ended.
        """
        while not self._chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def _take(self) -> bytes:
        """What arrived and was not returned yet, as one bytes object; reading resumes if the
        buffer had paused it."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def body(self) -> bytes:
        """The whole body (what :meth:`chunk` has not returned yet).

        Raises:
            ConnectionError: as :meth:`chunk`.
        """
        parts: list[bytes] = []
        while True:
            data = await self.chunk()
            if not data:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            parts.append(data)

    def ended_body(self) -> bytes:
        """:meth:`body` of an answer that ended (:attr:`complete`), without a coroutine:
        what arrived and was not returned yet."""
        assert self.complete, "ended_body() before the answer ended"
        return self._take()

    def release(self) -> None:
        """Done with the exchange: back to the pool when its answer ended and the connection
        stays alive, else closed."""
        if (self.complete and self._keep_alive and not self.closed and not self._chunks
                and self._writer is None):
            self._reset()
            self._pool.idle(self)
        else:
            self.close()

    def close(self) -> None:
        """Close the connection (the worker sees its client go)."""
        if not self.closed:
            self.closed = True
            self._pool.lost(self)
            if self._writer is not None and self._writer is not asyncio.current_task():
                self._writer.cancel()
            if self.transport is not None:
                self.transport.close()

    def _reset(self) -> None:
        self.status = 0
        self.headers = []
        self.head_done = self.complete = self._keep_alive = False
        self._buffered = 0

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._wake_head()
        self._wake_body()

    def _wake_head(self) -> None:
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def _wake_body(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class ConnectionPool:
    """Idle connections per ``(host, port)``, at most ``max_connections`` open in all.

    Args:
        max_connections: connections open at once, busy and idle; one more waits for a free
            one.
        idle_keepalive: seconds an idle connection is kept for reuse.
        clock: the clock idle times (and kept addresses) are measured with.
        resolver: looks hosts up (a :class:`~router.http.resolver.Resolver` on ``clock``).
    """

    def __init__(self, max_connections: int, idle_keepalive: float,
                 clock: Callable[[], float] = time.monotonic,
                 resolver: Resolver | None = None) -> None:
        self.max_connections = max_connections
        #: Looks hosts up for new connections, keeping the answers (:mod:`.resolver`).
        self.resolver = resolver or Resolver(clock=clock)
        self.idle_keepalive = idle_keepalive
        self._clock = clock
        self._idle: dict[tuple[str, int], list[Exchange]] = {}
        self._open: set[Exchange] = set()
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    def __len__(self) -> int:
        return len(self._open)

    async def acquire(self, host: str, port: int, tls: ssl.SSLContext | None = None
                      ) -> Exchange:
        """An idle connection to ``host:port`` (:meth:`take_idle`), or a new one
        (:meth:`open`)."""
        return self.take_idle(host, port) or await self.open(host, port, tls)

    def take_idle(self, host: str, port: int) -> Exchange | None:
        """The most recently used idle connection to ``host:port`` that is still open and
        within its keep-alive, if any; the expired ones found on the way are closed."""
        idle = self._idle.get((host, port))
        if idle:
            now = self._clock()
            while idle:
                exchange = idle.pop()
                if not exchange.closed and now - exchange.idle_since < self.idle_keepalive:
                    return exchange
                exchange.close()
        return None

    async def open(self, host: str, port: int, tls: ssl.SSLContext | None = None
                   ) -> Exchange:
        """A new connection to ``host:port`` (over TLS with ``tls``), once fewer than
        ``max_connections`` are open.

        Raises:
            OSError: the connection could not be opened (refused, unreachable).
        """
        while len(self._open) >= self.max_connections:
            if not self._close_oldest_idle():
                waiter = asyncio.get_running_loop().create_future()
                self._waiting.append(waiter)
                try:
                    await waiter
                finally:
                    if waiter in self._waiting:
                        self._waiting.remove(waiter)
        exchange = Exchange(self, (host, port))
        self._open.add(exchange)
        try:
            addresses = await self.resolver.resolve(host, port)
            loop = asyncio.get_running_loop()
            for i, (family, address) in enumerate(addresses):
                try:
                    await loop.create_connection(
                        lambda: exchange, address, port, family=family, ssl=tls,
                        server_hostname=host if tls else None)
                    break
                except OSError:
                    if i == len(addresses) - 1:
                        raise
        except BaseException:
            self.lost(exchange)
            raise
        return exchange

    def idle(self, exchange: Exchange) -> None:
        """Keep ``exchange`` for the next request to its worker."""
        exchange.idle_since = self._clock()
        self._idle.setdefault(exchange.key, []).append(exchange)

    def lost(self, exchange: Exchange) -> None:
        """``exchange`` is closed: forget it, and let a waiting request open one."""
        if exchange in self._open:
            self._open.discard(exchange)
            idle = self._idle.get(exchange.key)
            if idle and exchange in idle:
                idle.remove(exchange)
            while self._waiting:
                waiter = self._waiting.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    break

    def close(self) -> None:
        """Close every connection."""
        for exchange in list(self._open):
            exchange.close()
        self._idle.clear()

    def _close_oldest_idle(self) -> bool:
        oldest: Exchange | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest.idle_since):
                oldest = idle[0]
        if oldest is None:
            return False
        oldest.close()
        return True
