"""Forwards a request to the chosen worker and passes the answer back as it arrives.

The scheduler decides; this module only sends (Dynamo's rule: "the router decides which worker;
it does not send you there"). Forwarding uses one pooled aiohttp ``ClientSession``: measured
here, FastAPI forwarding through httpx's AsyncClient served 324 req/s against aiohttp's 2,928
req/s on the same box, so httpx stays for control calls and tests, never the hot path.

Failure rules:

- A worker that fails before the first byte of its answer raises :class:`UpstreamUnavailable`
  and the caller retries on the next-best worker. Failing means: refused, reset, timed out
  connecting, a 5xx status, a stream whose first event is an error (the engine failed the request
  before its first token), or no first byte by the request's deadline. The first byte of a stream is
  its first body chunk, not its headers (an HTTP server sends those before the engine has produced
  anything). The deadline is the caller's (what it expects the worker to need, see
  :mod:`router.http.first_byte`), capped by ``ProxyTimeouts.first_byte``; and every wait is
  registered in the worker's :class:`~router.fleet.first_byte_waits.FirstByteWaits`, which the
  health poll ends at once when the worker stops answering (a paused or wedged process).
- A failure after the first byte cannot be retried: a streaming answer ends with an SSE error
  event (``data: {"error": ...}``) and ``data: [DONE]``, never a silent truncation.
- Closing the returned stream (a client that went away) closes the upstream connection, which
  the worker sees as a disconnect and cancels the request.

Exceptions from aiohttp are translated here and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from router.fleet.first_byte_waits import FirstByteWaits
from router.http.incoming_body import IncomingBody

__all__ = ["Proxy", "ProxyTimeouts", "UpstreamAnswer", "UpstreamUnavailable"]

# A stream that opens with an error event failed before its first token.
_SSE_ERROR = re.compile(rb'\s*data:\s*\{\s*"error"')

# Hop-by-hop and length headers are the proxy's own business, never copied through.
_DROP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                           "content-encoding", "host", "te", "trailer", "upgrade",
                           "proxy-authorization", "proxy-authenticate", "date", "server"})


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
    headers: dict[str, str]
    response: aiohttp.ClientResponse
    timeouts: ProxyTimeouts
    first_chunk: bytes = b""
    #: Called whenever body bytes arrive: the worker's data path is alive
    #: (:mod:`router.fleet.liveness`).
    on_progress: Callable[[], None] | None = None
    #: Set when the stream failed after its first byte (its last chunk is an SSE error).
    broken: bool = False

    async def read(self) -> bytes:
        """Read the whole body (non-streaming answers), then release the connection.

        Raises:
            UpstreamUnavailable: the body did not arrive (nothing was sent to the client yet).
        """
        try:
            async with asyncio.timeout(self.timeouts.first_byte):
                body = await self.response.read()
            if self.on_progress is not None:
                self.on_progress()
            return body
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"worker failed while sending its answer: {exc}",
                                      "connect") from exc
        finally:
            self.response.release()

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """Yield the body as it arrives; a failure midway yields an SSE error event last.

        Closing the generator early closes the upstream connection.
        """
        try:
            if self.first_chunk:
                yield self.first_chunk
            while True:
                async with asyncio.timeout(self.timeouts.between_chunks):
                    chunk = await self.response.content.readany()
                if not chunk:
                    return
                if self.on_progress is not None:
                    self.on_progress()
                yield chunk
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            message = f"the worker failed mid-stream: {type(exc).__name__}: {exc}".rstrip(": ")
            self.broken = True
            yield sse_error(message, "upstream_error")
        finally:
            self.response.close()

    def close(self) -> None:
        """Drop the upstream connection without reading further."""
        self.response.close()


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
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the connection pool."""
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                         keepalive_timeout=IDLE_KEEPALIVE_S,
                                         enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=self.timeouts.total,
                                        sock_connect=self.timeouts.connect)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                              auto_decompress=False)

    async def close(self) -> None:
        """Close the pool; safe to call twice."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, url: str, body: bytes | IncomingBody, headers: Mapping[str, str], *,
                   stream: bool | Callable[[], bool] = False, first_byte: float | None = None,
                   waits: FirstByteWaits | None = None) -> UpstreamAnswer:
        """POST ``body`` to ``url`` and wait for its first byte: the status line and headers,
        and for a ``stream`` its first chunk too.

        Args:
            url: the worker's endpoint.
            body: the request body, forwarded as is: bytes, or a body still arriving, sent
                as it arrives (with the client's ``Content-Length`` when it declared one,
                else chunked).
            headers: the client's headers (hop-by-hop ones are dropped).
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
        if self._session is None:
            raise RuntimeError("proxy is not started")
        forward = {k: v for k, v in headers.items() if k.lower() not in _DROP_HEADERS}
        data: bytes | AsyncIterator[bytes]
        if isinstance(body, IncomingBody):
            data = body.chunks()
            if body.declared is not None:
                forward["Content-Length"] = str(body.declared)
        else:
            data = body
        limit = self.timeouts.first_byte if first_byte is None else min(
            first_byte, self.timeouts.first_byte)
        response: aiohttp.ClientResponse | None = None
        first = b""
        streamed = False
        try:
            async with asyncio.timeout(limit) as timeout:
                with waits.waiting(timeout) if waits is not None else contextlib.nullcontext():
                    response = await self._session.post(url, data=data, headers=forward)
                    streamed = stream() if callable(stream) else stream
                    if streamed and response.status == 200:
                        first = await response.content.readany()
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            if response is not None:
                response.close()
            if isinstance(exc, TimeoutError):
                raise UpstreamUnavailable(
                    f"{url}: no first byte within {limit:.1f}s, or the worker stopped "
                    f"answering its health probe", "deadline") from exc
            raise UpstreamUnavailable(f"{url}: {type(exc).__name__}: {exc}", "connect") from exc
        except asyncio.CancelledError:  # the client went away, or shutdown
            if response is not None:
                response.close()
            raise
        if response.status >= 500:
            detail = (await response.read())[:200].decode(errors="replace")
            response.release()
            raise UpstreamUnavailable(f"{url}: status {response.status}: {detail}", "status")
        if streamed and response.status == 200 and (not first or _SSE_ERROR.match(first)):
            response.close()
            detail = first[:200].decode(errors="replace").strip() or "an empty stream"
            raise UpstreamUnavailable(f"{url}: the stream failed before its first token: "
                                      f"{detail}", "stream_error")
        kept = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_HEADERS}
        return UpstreamAnswer(response.status, kept, response, self.timeouts, first)
