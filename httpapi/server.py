"""The uvicorn server both apps run on, with limits on connections and on slow or idle clients.

Rules:
    1. At most ``max_connections`` connections are served; a request that arrives while that
       many are open (idle ones included) is answered 503 at once (uvicorn's
       ``limit_concurrency``), and a connection past twice the limit is closed as soon as it is
       accepted, so idle sockets cannot use up the process's file descriptors.
    2. A connection must deliver a request's headers within ``header_timeout`` seconds of
       opening (or of the request's first byte, on a kept-alive connection), or it is closed:
       uvicorn by itself waits forever for a client that connects and says nothing.
    3. A kept-alive connection idle for ``keep_alive_timeout`` seconds between requests is
       closed (uvicorn's ``timeout_keep_alive``).
    4. A connection closed while the client is still sending a body (an upload refused with
       413) is closed gently: the answer is sent with a FIN, and what the client goes on sending
       is read and dropped for up to ``LINGER_SECONDS`` or ``LINGER_BYTES``. Closing a socket
       with unread data makes the kernel send a reset, which can destroy the answer before the
       client reads it (nginx's "lingering close").
    5. A request's head (request line and headers) over ``max_header_bytes`` is answered 431
       with ``Connection: close``, then closed as in rule 4: exactly when the head completes,
       and while it still arrives once the reads after the one it began in pass the limit
       (httptools by itself holds a head of any size). Behind pipelined requests the 431
       follows their answers.
    6. A request body must arrive within ``body_timeout`` seconds, with no pause over
       ``body_idle_timeout``, or it is answered 408 (:mod:`httpapi.deadlines`).
    7. An app's raw routes (:mod:`httpapi.app` rule 5: the router's ``/v1/completions`` and
       ``/v1/chat/completions``) are served by the connection's protocol itself
       (:class:`httpapi.lean_cycle.LeanCycle`), not through uvicorn's cycle and the
       middleware around the app: same answers, about a fifth less CPU per forwarded
       request (``bench/router.py``'s docstring has the figures). Only an exact path takes
       this way (one with a query string or an escape goes through the app, to the same
       route). ``KVROUTE_LEAN_HTTP=0`` in the environment turns it off, for comparison.

    8. A request's framing is read one way only: a ``Transfer-Encoding`` other than exactly
       ``chunked`` (``gzip, chunked``, say, which httptools takes as chunked and so would
       pass on a body still coded) is answered 400 with ``Connection: close`` as the head
       completes, then closed as in rule 4, so no byte of it reaches the app or a worker
       (httptools itself refuses a ``Content-Length`` beside ``Transfer-Encoding``, two
       lengths, and a length or chunk size that is not a plain number). A chunked body's
       trailer fields are dropped: httptools reports them as headers, which uvicorn would
       add to the request's headers after the app has begun, where a client could put any
       header past a proxy in front that checked the head.

Refusals under rules 5, 6 and 8 are counted in ``kvroute_http_refusals_total``
(:mod:`httpapi.refusals`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from httpapi.deadlines import BodyDeadline
from httpapi.lean_cycle import LeanCycle
from httpapi.logs import RequestIds
from httpapi.refusals import count_refusal

__all__ = ["DEFAULT_LIMITS", "LEAN_ENV", "ConnectionLimits", "raise_open_file_limit",
           "server_config"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The limits of the module docstring's rules, in connections and seconds."""

    max_connections: int = 2048
    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    max_header_bytes: int = 64 * 1024
    body_timeout: float = 120.0
    body_idle_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be positive, got {self.max_connections}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be at least 1024, got "
                             f"{self.max_header_bytes}")
        for name in ("header_timeout", "keep_alive_timeout", "body_timeout",
                     "body_idle_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


DEFAULT_LIMITS = ConnectionLimits()
#: Rule 7's switch: ``0`` serves the raw routes through the app, as every other route.
LEAN_ENV = "KVROUTE_LEAN_HTTP"
#: Rule 4's bounds on reading a refused upload's remainder.
LINGER_SECONDS = 2.0
LINGER_BYTES = 8 * 1024 * 1024
#: A deadline within this many seconds of the loop's time counts as passed: the loop's
#: timers round to milliseconds, and may fire that much before the time they were set for.
_DUE_SLACK = 0.001
#: Rule 5's answer.
_HEAD_TOO_LARGE = (b'{"error": {"message": "the request headers are over %d bytes", '
                   b'"type": "invalid_request_error", "param": null, '
                   b'"code": "request_header_fields_too_large"}}')
_FRAMING_BODY = (b'{"error": {"message": "Transfer-Encoding must be chunked, alone", '
                 b'"type": "invalid_request_error", "param": null, "code": "bad_framing"}}')
#: Rule 8's answer.
_BAD_FRAMING = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                % (len(_FRAMING_BODY), _FRAMING_BODY))


class _LingeringTransport:
    """The connection's transport, except that :meth:`close` follows rule 4 while the request
    body is still arriving. Everything else is the real transport's."""

    def __init__(self, transport: asyncio.Transport, protocol: _GuardedProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._transport, name)
        if callable(value):  # kept: the next call finds the transport's own method at once
            setattr(self, name, value)
        return value

    def close(self) -> None:
        protocol = self._protocol
        cycle = protocol.cycle
        if (protocol.lingering or cycle is None or not cycle.more_body
                or self._transport.is_closing() or not self._transport.can_write_eof()):
            self._transport.close()
            return
        protocol.linger(self._transport)


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with rule 1's hard cap, rule 2's header timer, rules 4
    and 5, and rule 7's raw routes."""

    limits = DEFAULT_LIMITS
    #: Rule 7: the raw routes by path, and what names their requests.
    lean: Mapping[bytes, Any] = {}
    lean_ids: RequestIds | None = None
    lingering = False
    #: Rules 2 and 3 share one timer a connection, re-armed lazily (:meth:`_arm_due`): the
    #: head's deadline and the idle connection's, in loop time (None: not running), and
    #: the timer with the time it fires at.
    _head_due: float | None = None
    _idle_due: float | None = None
    _due_timer: asyncio.TimerHandle | None = None
    _due_at = 0.0
    _linger_timer: asyncio.TimerHandle | None = None
    _lingered = 0
    #: Rule 5: whether the current request's head is complete, and its bytes so far.
    _head_done = True
    _head_bytes = 0
    #: Set once a head was refused: nothing more of this connection reaches the app.
    _refused = False
    #: The 431 waits for the answers to the requests pipelined before the refused one.
    _refusal_pending = False
    #: Rule 8's answer, when that is the refusal (else rule 5's 431).
    _refusal_answer: bytes | None = None
    #: Whether a request began in the read being parsed (rule 5 counts no bytes of that read
    #: while its head is open: some of them may belong to the request before).
    _began_in_read = False
    #: The current head's fields' bytes as rule 5 counts them (name, value and 4 a field),
    #: and its ``Transfer-Encoding`` values (rule 8), counted as they arrive.
    _field_bytes = 0
    _codings: list[bytes] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        if len(self.connections) > 2 * self.limits.max_connections:
            transport.abort()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_due = self._idle_due = None
        if self._due_timer is not None:
            self._due_timer.cancel()
            self._due_timer = None
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        cycle = self.cycle
        super().connection_lost(exc)
        if type(cycle) is LeanCycle:
            cycle.connection_lost()

    def linger(self, transport: asyncio.Transport) -> None:
        """Send what is buffered and a FIN, then drop what arrives until the client closes,
        or rule 4's bounds are reached."""
        self.lingering = True
        transport.write_eof()
        transport.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused and not self.lingering:
            return
        if not self.lingering:
            self._began_in_read = False
            super().data_received(data)
            if not self._head_done and not self._refused and not self._began_in_read:
                # Every byte of a later read after which the head is still open belongs to it;
                # the exact size is checked when the head completes.
                self._head_bytes += len(data)
                if self._head_bytes > self.limits.max_header_bytes:
                    self._refuse_head()
            return
        self._lingered += len(data)
        if self._lingered > LINGER_BYTES:
            self.transport.close()

    def eof_received(self) -> None:
        if self.lingering:
            self.transport.close()

    def on_message_begin(self) -> None:
        if self._refused:  # a request pipelined behind a refused head
            return
        super().on_message_begin()
        self._head_done, self._head_bytes, self._began_in_read = False, 0, True
        self._field_bytes, self._codings = 0, None
        if self._head_due is None:
            self._arm_header_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_done:  # a trailer field once the head is done (rule 8): dropped
            return
        # uvicorn's own on_header (``HttpToolsProtocol.on_header``), in this one call (a
        # call per header less), counting the head's bytes (rule 5) and its codings (rule 8)
        # as the fields arrive.
        name = name.lower()
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        elif name == b"transfer-encoding":
            if self._codings is None:
                self._codings = []
            self._codings.append(value)
        self._field_bytes += len(name) + len(value) + 4
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._disarm_header_timer()
        self._head_done = True
        if len(self.url) + self._field_bytes > self.limits.max_header_bytes:
            self._refuse_head()
            return
        codings = self._codings
        if codings and b",".join(codings).strip(b" \t").lower() != b"chunked":
            self._refuse_head(_BAD_FRAMING, "bad_framing")
            return
        if not self._lean_start():
            super().on_headers_complete()

    def _lean_start(self) -> bool:
        """Rule 7: start the request on a :class:`LeanCycle` if it is a raw route's; False
        for any other (uvicorn's cycle serves it, or answers it 503 past the limit)."""
        route = self.lean.get(self.url)
        if route is None:
            return False
        parser = self.parser
        if parser.get_method() != b"POST" or parser.should_upgrade():
            return False
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            return False
        version = parser.get_http_version()
        scope: dict[str, Any] = self.scope  # type: ignore[assignment]
        scope["method"] = "POST"
        if version != "1.1":
            scope["http_version"] = version
        scope["path"] = self.url.decode("ascii")
        scope["raw_path"] = self.url
        scope["query_string"] = b""
        existing = self.cycle
        assert self.lean_ids is not None, "raw routes come with their request ids"
        self.cycle = cycle = LeanCycle(  # type: ignore[assignment]
            scope, self.transport, self.flow, self.server_state.default_headers,
            version != "1.0" and parser.should_keep_alive(), self.expect_100_continue,
            self.on_response_complete, self.lean_ids, self.limits.body_timeout,
            self.limits.body_idle_timeout, self.loop, self.tasks)
        if existing is None or existing.response_complete:
            # The task leaves self.tasks as its cycle ends (LeanCycle.run_asgi).
            self.tasks.add(self.loop.create_task(cycle.run_asgi(route)))
        else:  # pipelined behind an answer still being sent: uvicorn starts it then
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, route))  # type: ignore[arg-type]
        return True

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        # uvicorn's own, with rule 3's deadline set on the shared timer rather than a timer
        # armed here and cancelled at the next read, twice a request with rule 2's.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_due = None
        self.flow.resume_reading()
        if self.pipeline:  # a pipelined request starts now
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:  # idle until the next request
            self._idle_due = self.loop.time() + self.timeout_keep_alive
            self._arm_due()
        if self._refusal_pending and not self.pipeline:
            self._refusal_pending = False
            self._answer_431()

    def _refuse_head(self, answer: bytes | None = None, reason: str = "headers_too_large"
                     ) -> None:
        """Rule 5 (or 8, with its ``answer``): answer 431 (or ``answer``) and close; what
        the client goes on sending is dropped."""
        self._disarm_header_timer()
        self._refused = True
        if answer is not None:
            self._refusal_answer = answer
        count_refusal(reason)
        if self.pipeline or (self.cycle is not None and not self.cycle.response_complete):
            # Requests pipelined before this one are still being answered: a 431 written now
            # would land inside their answers.
            self._refusal_pending = True
            return
        self._answer_431()

    def _answer_431(self) -> None:
        if self.transport.is_closing():
            return
        answer = self._refusal_answer
        if answer is None:
            body = _HEAD_TOO_LARGE % self.limits.max_header_bytes
            answer = (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                      b"content-type: application/json\r\nconnection: close\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.linger(self.transport)  # type: ignore[arg-type]
        else:
            self.transport.close()

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn's call at every read: the connection is no longer idle (rule 3). The
        # shared timer runs on and finds no deadline due.
        self._idle_due = None

    def _arm_header_timer(self) -> None:
        self._head_due = self.loop.time() + self.limits.header_timeout
        self._arm_due()

    def _disarm_header_timer(self) -> None:
        self._head_due = None

    def _arm_due(self) -> None:
        """Have the shared timer fire by the earliest deadline running: one armed to fire
        no later is kept (it re-arms itself for a deadline that moved on, :meth:`_due`), so
        a busy connection re-arms it about once a keep-alive timeout instead of twice a
        request."""
        head, idle = self._head_due, self._idle_due
        due = head if idle is None else idle if head is None else min(head, idle)
        if due is None:
            return
        timer = self._due_timer
        if timer is not None:
            if self._due_at <= due:
                return
            timer.cancel()
        self._due_at = due
        self._due_timer = self.loop.call_at(due, self._due)

    def _due(self) -> None:
        """The shared timer fired: close the connection if a deadline passed (rules 2 and
        3: its head too slow, or idle too long), else wait for the next one."""
        self._due_timer = None
        now = self.loop.time() + _DUE_SLACK
        head, idle = self._head_due, self._idle_due
        if (head is not None and head <= now) or (idle is not None and idle <= now):
            self._head_due = self._idle_due = None
            if not self.transport.is_closing():
                self.transport.close()
            return
        self._arm_due()


@runtime_checkable
class RawRoutes(Protocol):
    """An app with raw routes the server may serve itself (rule 7; :mod:`httpapi.app`)."""

    @property
    def request_ids(self) -> RequestIds:
        """Names each request."""

    def raw_routes(self) -> Mapping[bytes, Any]:
        """The raw routes by path, each answering its own refusals."""


def server_config(app: Any, host: str, port: int, limits: ConnectionLimits,
                  log_level: str = "info", **extra: Any) -> uvicorn.Config:
    """A uvicorn configuration serving ``app`` under ``limits`` (the module's rules).

    Args:
        app: the ASGI app.
        host: the bind address.
        port: the port (0: any free one).
        limits: connection limits and timeouts.
        log_level: uvicorn's log level.
        extra: further ``uvicorn.Config`` arguments.
    """
    lean: dict[str, Any] = {"limits": limits}
    if os.environ.get(LEAN_ENV, "1") != "0" and isinstance(app, RawRoutes):
        lean.update(lean=app.raw_routes(), lean_ids=app.request_ids)
    protocol = type("GuardedHttpProtocol", (_GuardedProtocol,), lean)
    # No access log and nothing reads the client's address, so uvicorn's rewriting of it from
    # X-Forwarded-For (one more middleware call per request) is off.
    options: dict[str, Any] = {"access_log": False, "timeout_graceful_shutdown": 5,
                               "proxy_headers": False, **extra}
    app = BodyDeadline(app, limits.body_timeout, limits.body_idle_timeout)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          limit_concurrency=limits.max_connections,
                          # uvicorn types it int but sleeps any number of seconds
                          timeout_keep_alive=cast(int, limits.keep_alive_timeout), **options)


def raise_open_file_limit(limits: ConnectionLimits) -> None:
    """Raise this process's soft file-descriptor limit to its hard limit, and warn when even
    that is too low for rule 1's cap (each connection is one descriptor; a router's request
    holds a second one to its worker)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    needed = 4 * limits.max_connections + 256
    if soft < needed:
        log.warning("the open file limit (%d) is below %d, what %d connections may need; "
                    "lower --max-connections or raise the limit", soft, needed,
                    limits.max_connections)
