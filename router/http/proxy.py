"""Forwards a request to the chosen worker and passes the answer back as it arrives.

The scheduler decides; this module only sends (Dynamo's rule: "the router decides which worker;
it does not send you there"). Forwarding uses a pool of kept-alive HTTP/1.1 connections with
httptools' parser (:mod:`router.http.upstream`): measured here, FastAPI forwarding through
httpx's AsyncClient served 324 req/s against aiohttp's 2,928 req/s on the same box, and
aiohttp's client cost more CPU per request than the pool (``bench/router.py``'s docstring has
the figures), so httpx stays for control calls and tests, never the hot path.

Failure rules:

- A worker that fails before the first byte of its answer raises :class:`UpstreamUnavailable`
  and the caller retries on the next-best worker. Failing means: refused, reset, timed out
  connecting, a 5xx status, a stream whose first event is an error (the engine failed the request
  before its first token), or no first byte by the request's deadline. The first byte of a stream is
  its first body chunk, not its headers (an HTTP server sends those before the engine has produced
  anything). The deadline is the caller's (what it expects the worker to need, see
  :mod:`router.http.first_byte`), capped by ``ProxyTimeouts.first_byte``; and every wait is
  registered in the worker's :class:`~router.fleet.first_byte_waits.FirstByteWaits`, which the
  health poll ends at once when the worker stops answering (a paused or wedged process). The
  deadlines of every send in flight are kept by one timer (:mod:`router.http.deadlines`).
- A failure after the first byte cannot be retried: a streaming answer ends with an SSE error
  event (``data: {"error": ...}``) and ``data: [DONE]``, never a silent truncation.
- Closing the returned stream (a client that went away) closes the upstream connection, which
  the worker sees as a disconnect and cancels the request.

Connection errors (``OSError``, ``ConnectionError``) are translated here and nowhere else.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from router.fleet.first_byte_waits import FirstByteWait, FirstByteWaits
from router.http.deadlines import Deadlines
from router.http.incoming_body import IncomingBody
from router.http.upstream import ConnectionPool, Exchange

__all__ = ["Proxy", "ProxyTimeouts", "UpstreamAnswer", "UpstreamUnavailable"]

# A stream that opens with an error event failed before its first token.
_SSE_ERROR = re.compile(rb'\s*data:\s*\{\s*"error"')

# Hop-by-hop and length headers are the proxy's own business, never copied through.
# (expect: the router's own server answered the client's 100-continue already.)
_DROP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                           "content-encoding", "host", "te", "trailer", "upgrade", "expect",
                           "proxy-authorization", "proxy-authenticate", "date", "server"})
_DROP_BYTES = frozenset(h.encode() for h in _DROP_HEADERS)
#: Worker URLs parsed, at most this many kept (a fleet's endpoints, so a few per worker).
_MAX_TARGETS = 4096


class UpstreamUnavailable(Exception):
    """The worker failed before sending any byte of its answer: safe to retry elsewhere.

    Attributes:
        cause: ``connect`` (refused, reset, closed), ``deadline`` (no first byte in time, or
            given up by the health poll), ``status`` (5xx) or ``stream_error`` (a stream that
            opened with an error event).
    """

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


#: Seconds an idle pooled connection is kept. Below uvicorn's (and so vLLM's) 5 s server-side
#: keep-alive: a connection the worker has already closed is never reused, which would fail
#: the send with ``ServerDisconnectedError`` and move the request off its prefix holder (seen
#: on the GPU routing benchmark with a 60 s pool).
IDLE_KEEPALIVE_S = 4.0


@dataclass(frozen=True, slots=True)
class ProxyTimeouts:
    """Seconds allowed for each phase of a forwarded request."""

    connect: float = 2.0
    first_byte: float = 300.0
    between_chunks: float = 120.0
    total: float = 3600.0


@dataclass(slots=True)
class UpstreamAnswer:
    """A worker's answer whose status and headers arrived (and, for a stream, its first
    chunk); the body is read by the caller."""

    status: int
    #: The worker's headers as sent, less the hop-by-hop and length ones.
    raw_headers: list[tuple[bytes, bytes]]
    exchange: Exchange
    timeouts: ProxyTimeouts
    first_chunk: bytes = b""
    #: Called whenever body bytes arrive: the worker's data path is alive
    #: (:mod:`router.fleet.liveness`).
    on_progress: Callable[[], None] | None = None
    #: Set when the stream failed after its first byte (its last chunk is an SSE error).
    broken: bool = False

    @property
    def headers(self) -> dict[str, str]:
        """:attr:`raw_headers`, decoded."""
        return {k.decode("latin-1"): v.decode("latin-1") for k, v in self.raw_headers}

    def header(self, name: str) -> str | None:
        """The value of the header ``name`` (lower case; the last one sent), decoded; None
        when absent."""
        wanted, found = name.encode("latin-1"), None
        for k, v in self.raw_headers:
            if k.lower() == wanted:
                found = v
        return None if found is None else found.decode("latin-1")

    async def read(self) -> bytes:
        """Read the whole body (non-streaming answers), then release the connection.

        Raises:
            UpstreamUnavailable: the body did not arrive (nothing was sent to the client yet).
        """
        exchange = self.exchange
        try:
            if exchange.complete:  # the usual case: it came with the head
                body = exchange.ended_body()
            else:
                async with asyncio.timeout(self.timeouts.first_byte):
                    body = await exchange.body()
            if self.on_progress is not None:
                self.on_progress()
            return body
        except (ConnectionError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"worker failed while sending its answer: {exc}",
                                      "connect") from exc
        finally:
            exchange.release()

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """Yield the body as it arrives; a failure midway yields an SSE error event last.

        Closing the generator early closes the upstream connection.
        """
        exchange = self.exchange
        try:
            if self.first_chunk:
                yield self.first_chunk
            while True:
                async with asyncio.timeout(self.timeouts.between_chunks):
                    chunk = await exchange.chunk()
                if not chunk:
                    return
                if self.on_progress is not None:
                    self.on_progress()
                yield chunk
        except (ConnectionError, TimeoutError) as exc:
            message = f"the worker failed mid-stream: {type(exc).__name__}: {exc}".rstrip(": ")
            self.broken = True
            yield sse_error(message, "upstream_error")
        finally:
            exchange.release()

    def close(self) -> None:
        """Drop the upstream connection without reading further."""
        self.exchange.close()


def sse_error(message: str, kind: str) -> bytes:
    """Return an SSE error event followed by the end marker."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": 502}})
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class Proxy:
    """A pooled HTTP client that forwards bodies to workers.

    Args:
        timeouts: per-phase limits.
        max_connections: pool size across all workers.
    """

    def __init__(self, timeouts: ProxyTimeouts | None = None, max_connections: int = 1024
                 ) -> None:
        self.timeouts = timeouts or ProxyTimeouts()
        self._max_connections = max_connections
        self._pool: ConnectionPool | None = None
        self._deadlines: Deadlines | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: url -> (host, port, TLS context, the request line and Host header)
        self._targets: dict[str, tuple[str, int, ssl.SSLContext | None, bytes]] = {}

    async def start(self) -> None:
        """Open the connection pool."""
        self._pool = ConnectionPool(self._max_connections, IDLE_KEEPALIVE_S)
        self._loop = asyncio.get_running_loop()
        self._deadlines = Deadlines(self._loop)

    async def close(self) -> None:
        """Close the pool; safe to call twice."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._deadlines is not None:
            self._deadlines.close()
            self._deadlines = None

    def _target(self, url: str) -> tuple[str, int, ssl.SSLContext | None, bytes]:
        found = self._targets.get(url)
        if found is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {url!r}")
            tls = ssl.create_default_context() if parts.scheme == "https" else None
            port = parts.port or (443 if tls else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            line = f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode("latin-1")
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            found = self._targets[url] = (parts.hostname, port, tls, line)
        return found

    async def _connect(self, pool: ConnectionPool, host: str, port: int,
                       tls: ssl.SSLContext | None) -> Exchange:
        try:
            async with asyncio.timeout(self.timeouts.connect):
                return await pool.open(host, port, tls)
        except TimeoutError:  # the connection's own limit, not the request's deadline
            raise ConnectionError(
                f"no connection within {self.timeouts.connect:g}s (looking up {host}, or "
                "connecting to it)") from None

    async def send(self, url: str, body: bytes | IncomingBody | AsyncIterable[bytes],
                   headers: Mapping[str, str], *, length: int | None = None,
                   stream: bool | Callable[[], bool] = False, first_byte: float | None = None,
                   waits: FirstByteWaits | None = None) -> UpstreamAnswer:
        """POST ``body`` to ``url`` and wait for its first byte: the status line and headers,
        and for a ``stream`` its first chunk too.

        Args:
            url: the worker's endpoint.
            body: the request body, forwarded as is: bytes, or a body still arriving (an
                :class:`~router.http.incoming_body.IncomingBody`, or chunks), sent as it
                arrives (an error it raises is raised here, unless the answer began).
            headers: the client's headers (hop-by-hop ones are dropped).
            length: the chunks' length, sent as their ``Content-Length`` (an
                ``IncomingBody`` gives the client's); without it a body still arriving goes
                in the chunked transfer coding.
            stream: whether the answer is a stream (its first chunk is awaited and checked);
                a callable is asked once the answer's headers are in (a body sent as it
                arrives says whether it asks for a stream only at its end).
            first_byte: seconds to wait for the first byte (capped by the proxy's own).
            waits: the worker's registry of waits, through which the health poll can end
                this one early.

        Raises:
            UpstreamUnavailable: no answer began (connection failed, deadline passed or the
                wait was given up, 5xx, or a stream that opened with an error event).
        """
        pool, deadlines = self._pool, self._deadlines
        if pool is None or deadlines is None:
            raise RuntimeError("proxy is not started")
        host, port, tls, line = self._target(url)
        hop = headers.get("connection")
        # The fields a Connection header names are for the client's hop only (RFC 9110
        # 7.6.1), like the hop-by-hop ones always dropped.
        drop = (_DROP_HEADERS if hop is None else _DROP_HEADERS | {
            t.strip().lower() for t in hop.split(",")})
        fields = []
        for k, v in headers.items():
            if k.lower() not in drop:
                fields.append(f"{k}: {v}\r\n")
        head = [line, "".join(fields).encode("latin-1")]  # one encode for every field
        incoming = body if isinstance(body, IncomingBody) else None
        if incoming is not None:
            length = incoming.declared
            body = incoming.chunks()
        whole = body if isinstance(body, bytes) else None
        if whole is not None:
            head.append(b"content-length: %d\r\n\r\n" % len(whole))
        elif length is not None:
            head.append(b"content-length: %d\r\n\r\n" % length)
        else:
            head.append(b"transfer-encoding: chunked\r\n\r\n")
        limit = self.timeouts.first_byte if first_byte is None else min(
            first_byte, self.timeouts.first_byte)
        exchange: Exchange | None = None
        first = b""
        streamed = False
        try:
            # The deadline is kept with every other wait's, by one timer.
            with FirstByteWait(asyncio.current_task(self._loop)) as wait:
                deadlines.add(wait, limit)
                if waits is not None:
                    waits.add(wait)
                try:
                    exchange = pool.take_idle(host, port)
                    reused = exchange is not None
                    while True:
                        if exchange is None:
                            exchange = await self._connect(pool, host, port, tls)
                        if whole is not None:
                            exchange.send(b"".join(head), whole)
                        else:
                            assert not isinstance(body, (bytes, IncomingBody))
                            exchange.send_streamed(b"".join(head), body,
                                                   chunked=length is None)
                        try:
                            await exchange.head()
                            break
                        except ConnectionError:
                            # A kept-alive connection the worker closed as it was reused
                            # (its own idle timeout, a restart): the worker never saw the
                            # request, so it goes once more on a new connection.
                            if not reused or exchange.head_done or (
                                    whole is None and incoming is None):
                                raise
                            exchange.close()
                            exchange, reused = None, False
                            if incoming is not None:
                                body = incoming.chunks()
                    streamed = stream() if callable(stream) else stream
                    if streamed and exchange.status == 200:
                        first = await exchange.chunk()
                finally:
                    deadlines.discard(wait)
                    if waits is not None:
                        waits.discard(wait)
        except (OSError, TimeoutError) as exc:  # ConnectionError is an OSError
            if exchange is not None:
                exchange.close()
            if isinstance(exc, TimeoutError):
                raise UpstreamUnavailable(
                    f"{url}: no first byte within {limit:.1f}s, or the worker stopped "
                    f"answering its health probe", "deadline") from exc
            raise UpstreamUnavailable(f"{url}: {type(exc).__name__}: {exc}", "connect") from exc
        except BaseException:  # the client went away, or shutdown
            if exchange is not None:
                exchange.close()
            raise
        status = exchange.status
        if status >= 500:
            try:
                async with asyncio.timeout(self.timeouts.connect):
                    detail = (await exchange.body())[:200].decode(errors="replace")
            except (ConnectionError, TimeoutError):
                detail = "(its body did not arrive)"
            exchange.release()
            raise UpstreamUnavailable(f"{url}: status {status}: {detail}", "status")
        if streamed and status == 200 and (not first or _SSE_ERROR.match(first)):
            exchange.close()
            detail = first[:200].decode(errors="replace").strip() or "an empty stream"
            raise UpstreamUnavailable(f"{url}: the stream failed before its first token: "
                                      f"{detail}", "stream_error")
        kept = [(k, v) for k, v in exchange.headers if k.lower() not in _DROP_BYTES]
        return UpstreamAnswer(status, kept, exchange, self.timeouts, first)
