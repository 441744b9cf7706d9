"""Forwards a request to the chosen worker and passes the answer back as it arrives.

The scheduler decides; this module only sends (Dynamo's rule: "the router decides which worker;
it does not send you there"). Forwarding uses one pooled aiohttp ``ClientSession``: measured
here, FastAPI forwarding through httpx's AsyncClient served 324 req/s against aiohttp's 2,928
req/s on the same box, so httpx stays for control calls and tests, never the hot path.

Failure rules (``shared/DESIGN.md``):

- A worker that fails before any byte of its answer (refused, reset, timed out connecting or
  waiting for headers, or a 5xx status) raises :class:`UpstreamUnavailable`; the caller may
  retry once on the next-best worker.
- A failure after the first byte cannot be retried: a streaming answer ends with an SSE error
  event (``data: {"error": ...}``) and ``data: [DONE]``, never a silent truncation.
- Closing the returned stream (a client that went away) closes the upstream connection, which
  the worker sees as a disconnect and cancels the request.

Exceptions from aiohttp are translated here and nowhere else.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp

__all__ = ["Proxy", "ProxyTimeouts", "UpstreamAnswer", "UpstreamUnavailable"]

# Hop-by-hop and length headers are the proxy's own business, never copied through.
_DROP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                           "content-encoding", "host", "te", "trailer", "upgrade",
                           "proxy-authorization", "proxy-authenticate", "date", "server"})


class UpstreamUnavailable(Exception):
    """The worker failed before sending any byte of its answer: safe to retry elsewhere."""


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
    """A worker's answer whose status and headers arrived; the body is read by the caller."""

    status: int
    headers: dict[str, str]
    response: aiohttp.ClientResponse
    timeouts: ProxyTimeouts

    async def read(self) -> bytes:
        """Read the whole body (non-streaming answers), then release the connection.

        Raises:
            UpstreamUnavailable: the body did not arrive (nothing was sent to the client yet).
        """
        try:
            async with asyncio.timeout(self.timeouts.first_byte):
                return await self.response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"worker failed while sending its answer: {exc}") from exc
        finally:
            self.response.release()

    async def stream(self) -> AsyncIterator[bytes]:
        """Yield the body as it arrives; a failure midway yields an SSE error event last.

        Closing the generator early closes the upstream connection.
        """
        try:
            while True:
                async with asyncio.timeout(self.timeouts.between_chunks):
                    chunk = await self.response.content.readany()
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            message = f"the worker failed mid-stream: {type(exc).__name__}: {exc}".rstrip(": ")
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

    async def send(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamAnswer:
        """POST ``body`` to ``url`` and wait for the status line and headers.

        Raises:
            UpstreamUnavailable: no answer began (connection failed, timed out, or 5xx).
        """
        if self._session is None:
            raise RuntimeError("proxy is not started")
        forward = {k: v for k, v in headers.items() if k.lower() not in _DROP_HEADERS}
        try:
            async with asyncio.timeout(self.timeouts.first_byte):
                response = await self._session.post(url, data=body, headers=forward)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise UpstreamUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc
        if response.status >= 500:
            detail = (await response.read())[:200].decode(errors="replace")
            response.release()
            raise UpstreamUnavailable(f"{url}: status {response.status}: {detail}")
        kept = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_HEADERS}
        return UpstreamAnswer(response.status, kept, response, self.timeouts)
