"""The request cycle of a raw route (:mod:`httpapi.app` rule 5), served by the connection's
own protocol (:mod:`httpapi.server` rule 7) instead of through the ASGI app around it.

uvicorn serves every request through its ``RequestResponseCycle`` and the middleware around
the app (the body deadline, the request ids, the raw-route dispatch). For a raw route,
:class:`LeanCycle` does the same work in one object:

1. the route gets the same ASGI ``receive`` and ``send`` (so it runs unchanged under either
   cycle), the same request id (:class:`httpapi.logs.RequestIds`: the client's when usable,
   named in the request's headers, the answer's and every log line) and the same refusals
   (rules 1 and 2 of :mod:`httpapi.app`, answered by the route given);
2. the body deadlines of :mod:`httpapi.deadlines`, with the same refusals and counts, but a
   timer only for a read that has to wait: a body that arrived with its headers is read with
   none;
3. the answer's status line and headers are written with its first body piece, one socket
   write for a whole answer instead of two; the server's default headers (``server``,
   ``date``) come first, as uvicorn writes them, the request id last;
4. a client that leaves is told to the route through :data:`DEPARTURE` in its scope: a
   function giving a future that completes when the connection is lost (the same future at
   each call, made at the first), where an ASGI route reads the receive channel in a task of
   its own to notice it. The router asks for it while a request waits in its flow-control
   queue and again once the request is sent (:mod:`router.http.request_path`).

What the route sends is not checked for characters that would break the framing (uvicorn's
cycle checks each header): the raw routes send their own headers and ones a worker sent,
which httptools parsed. Anything else (a 100-continue, keep-alive, ``Connection: close``,
content length or chunked coding, a 500 for a route that failed before answering) is as
uvicorn's cycle does it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from httpapi.deadlines import too_slow
from httpapi.logs import REQUEST_ID_HEADER, RequestIds

__all__ = ["DEPARTURE", "LeanCycle"]

log = logging.getLogger("uvicorn.error")

#: The scope key of the function that gives the client's departure (rule 4).
DEPARTURE = "kvroute.departure"

_REQUEST_ID = REQUEST_ID_HEADER.encode()
#: The answer's headers the cycle reads as it writes them.
_READ_HEADERS = frozenset({_REQUEST_ID, b"content-length", b"transfer-encoding", b"connection"})
_500 = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21"),
        (b"connection", b"close")]

App = Callable[[MutableMapping[str, Any], Any, Any], Any]


class LeanCycle:
    """One request to a raw route (rules in the module docstring). The connection's protocol
    (uvicorn's ``HttpToolsProtocol``) feeds :attr:`body`, :attr:`more_body` and
    :attr:`message_event` and reads :attr:`response_complete`, :attr:`disconnected` and
    :attr:`keep_alive`, as it does its own cycle's.

    Args:
        scope: the request's ASGI scope.
        transport: the connection.
        flow: uvicorn's flow control of the connection.
        default_headers: the server's headers for every answer.
        keep_alive: whether the connection may serve another request after this one.
        expect_100_continue: the client waits for ``100 Continue`` before its body.
        on_response: called when the answer is complete.
        ids: names the request.
        body_timeout: the whole body's deadline, seconds from the start.
        body_idle_timeout: the longest pause within the body, seconds.
        loop: the event loop the connection is served on.
        tasks: the server's set of request tasks, which the request's task leaves as it
            ends (no done callback, which the loop would run as a callback of its own).
    """

    __slots__ = ("_body_done", "_body_idle_timeout", "_body_timeout", "_chunked", "_deadline",
                 "_departed", "_head", "_ids", "_left", "_loop", "_request_id", "_tasks", "body",
                 "default_headers", "disconnected", "flow", "keep_alive", "message_event",
                 "more_body", "on_response", "response_complete", "response_started", "scope",
                 "transport", "waiting_for_100_continue")

    def __init__(self, scope: MutableMapping[str, Any], transport: asyncio.Transport, flow: Any,
                 default_headers: list[tuple[bytes, bytes]], keep_alive: bool,
                 expect_100_continue: bool, on_response: Callable[[], None], ids: RequestIds,
                 body_timeout: float, body_idle_timeout: float,
                 loop: asyncio.AbstractEventLoop,
                 tasks: set[asyncio.Task[None]] | None = None) -> None:
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self.default_headers = default_headers
        self.message_event = _Signal()
        self.on_response = on_response
        self.disconnected = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.body = b""
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self._ids = ids
        self._body_timeout = body_timeout
        self._body_idle_timeout = body_idle_timeout
        self._deadline = 0.0
        self._body_done = False
        self._departed: asyncio.Future[None] | None = None
        self._request_id = b""
        self._chunked: bool | None = None
        self._left = 0
        self._head: bytes | None = None
        self._loop = loop
        self._tasks = tasks

    async def run_asgi(self, app: App) -> None:
        """Serve the request with ``app`` (uvicorn's name: its protocol starts a pipelined
        request by calling it)."""
        scope, rid = self._ids.named(self.scope, in_place=True)
        scope[DEPARTURE] = self.departure
        self._request_id = rid.encode()
        self._deadline = time.monotonic() + self._body_timeout
        try:
            await app(scope, self.receive, self.send)
        except BaseException as exc:
            log.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self.transport.close()
        else:
            if not self.response_started and not self.disconnected:
                log.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                log.error("ASGI callable returned without completing response.")
                self.transport.close()
        finally:
            self.on_response = _nothing
            # The scope's bound method held this cycle in a reference cycle (the cycle holds
            # the scope): each request's cycle, events and futures then waited for the
            # cyclic collector, about 4 ms of every young collection under load.
            scope.pop(DEPARTURE, None)
            if self._tasks is not None:  # the server's set of request tasks: this one ends
                self._tasks.discard(asyncio.current_task(self._loop))  # type: ignore[arg-type]

    def departure(self) -> asyncio.Future[None]:
        """A future that completes when the client has left (rule 4); cancel it to stop
        caring."""
        if self._departed is None:
            self._departed = self._loop.create_future()
            if self.disconnected:
                self._departed.set_result(None)
        return self._departed

    def connection_lost(self) -> None:
        """The protocol saw the connection close (after marking :attr:`disconnected`)."""
        departed = self._departed
        if self.disconnected and departed is not None and not departed.done():
            departed.set_result(None)

    async def receive(self) -> dict[str, Any]:
        """The ASGI receive channel, with the body deadlines (rule 2)."""
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        event = self.message_event
        if not self.disconnected and not self.response_complete:
            flow = self.flow
            if flow.read_paused:
                flow.resume_reading()
            if self._body_done:
                await event.wait()
            else:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    raise too_slow(True, self._body_timeout, self._body_idle_timeout)
                if not event.is_set:
                    try:
                        async with asyncio.timeout(min(left, self._body_idle_timeout)):
                            await event.wait()
                    except TimeoutError:
                        raise too_slow(left <= self._body_idle_timeout, self._body_timeout,
                                       self._body_idle_timeout) from None
            event.is_set = False
        elif not self._body_done and self._deadline - time.monotonic() <= 0:
            raise too_slow(True, self._body_timeout, self._body_idle_timeout)
        if self.disconnected or self.response_complete:
            self._body_done = True
            return {"type": "http.disconnect"}
        body, more = self.body, self.more_body
        self.body = b""
        if not more:
            self._body_done = True
        return {"type": "http.request", "body": body, "more_body": more}

    async def send(self, message: dict[str, Any]) -> None:
        """The ASGI send channel (rule 3)."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got "
                                   f"'{kind}'.")
            self._start(message["status"], message.get("headers", ()))
            return
        if self.response_complete:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response "
                               f"already completed.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self._left:
                raise RuntimeError("Response content longer than Content-Length")
            self._left -= len(body)
            data = body
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        if data:
            self.transport.write(data)
        if not more:
            if self._left != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    def _start(self, status: int, headers: Any) -> None:
        """Build the status line and headers; they go out with the first body piece."""
        self.response_started = True
        self.waiting_for_100_continue = False
        content = [STATUS_LINE[status]]
        for name, value in self.default_headers:
            content += (name, b": ", value, b"\r\n")
        closing = False
        for name, value in headers:
            name = name.lower()
            if name in _READ_HEADERS:  # most headers are none of these: one lookup each
                if name == _REQUEST_ID:
                    continue
                if name == b"content-length" and self._chunked is None:
                    self._left = int(value)
                    self._chunked = False
                elif name == b"transfer-encoding" and value.lower() == b"chunked":
                    self._left = 0
                    self._chunked = True
                elif name == b"connection" and b"close" in [
                        t.strip().lower() for t in value.split(b",")]:
                    self.keep_alive = False
                    closing = True
            content += (name, b": ", value, b"\r\n")
        content += (_REQUEST_ID, b": ", self._request_id, b"\r\n")
        if not self.keep_alive and not closing:
            content.append(b"connection: close\r\n")
        if self._chunked is None and status not in (204, 304):
            self._chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self._head = b"".join(content)

    async def _send_500(self) -> None:
        await self.send({"type": "http.response.start", "status": 500, "headers": _500})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})


def _nothing() -> None:
    pass


class _Signal:
    """What the protocol sets when the request's body grows or the connection goes
    (:attr:`LeanCycle.message_event`): ``asyncio.Event``'s ``set`` and ``wait``, with its
    flag a plain attribute, and no future or waiter list made until something waits (a
    body that came with its headers is never waited for)."""

    __slots__ = ("_waiters", "is_set")

    def __init__(self) -> None:
        self.is_set = False
        self._waiters: list[asyncio.Future[None]] | None = None

    def set(self) -> None:
        """Set the flag and wake every waiter."""
        self.is_set = True
        waiters = self._waiters
        if waiters:
            self._waiters = None
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait(self) -> None:
        """Return once the flag is set."""
        if self.is_set:
            return
        waiter = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if self._waiters is not None and waiter in self._waiters:
                self._waiters.remove(waiter)
