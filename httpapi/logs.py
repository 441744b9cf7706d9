"""One log format for every kvroute process and the uvicorn server under it, with the id of
the request a line was written for.

:func:`configure_logging` installs one handler on the root logger, ``text`` (one readable
line) or ``json`` (one JSON object a line, for a log pipeline), and lets uvicorn's loggers
propagate to it (run uvicorn with ``log_config=None``). :class:`RequestIds` is ASGI middleware
that gives every HTTP request an id: the client's ``x-request-id`` when it sends a usable one,
else a new one, put into the request's headers (so the router forwards it to the worker, whose
lines then carry the same id) and into the answer's. Every line logged while the request is
handled names it.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["LOG_FORMATS", "REQUEST_ID_HEADER", "RequestIds", "configure_logging",
           "request_id"]

LOG_FORMATS = ("text", "json")
REQUEST_ID_HEADER = "x-request-id"
_HEADER = REQUEST_ID_HEADER.encode()
#: What a client's id may be: short and printable, so it cannot forge log lines.
_USABLE = re.compile(rb"[A-Za-z0-9._:-]{1,128}")

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvroute_request_id",
                                                                      default=None)
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def request_id() -> str | None:
    """The id of the request being handled, if any."""
    return _current.get()


class _WithRequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _current.get()
        return True


class _Text(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [request {rid}]" if rid else line


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, fmt: str = "text") -> None:
    """Log at ``level`` in ``fmt`` (``text`` or ``json``) from every logger, uvicorn's too.

    Raises:
        ValueError: an unknown format or level.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error")
    handler = logging.StreamHandler()
    handler.setFormatter(_Json() if fmt == "json" else _Text())
    handler.addFilter(_WithRequestId())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        # as an earlier uvicorn set-up in this process may have left it
        logger.disabled = False
        logger.setLevel(logging.NOTSET)
    # One line per health poll would drown everything else: control-call logs only on trouble.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, numeric))


_Scope = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class RequestIds:
    """ASGI middleware: every HTTP request gets an id (see the module docstring)."""

    def __init__(self, app: Callable[[_Scope, _Receive, _Send], Awaitable[None]]) -> None:
        self.app = app
        self._prefix = f"{os.getpid():x}{int(time.time()) & 0xFFFF:04x}"
        self._ids = itertools.count(1)

    def named(self, scope: _Scope, *, in_place: bool = False) -> tuple[_Scope, str]:
        """``scope`` with the request's id in its headers, and the id: the client's when
        usable, else a new one. Every line logged from here on in this task names it.
        ``in_place``: the scope and its header list are the caller's own, made for this
        request, so they are changed rather than copied."""
        headers = scope["headers"]
        given = None
        for k, v in headers:
            if k == _HEADER:
                given = v
                break
        if given is not None and _USABLE.fullmatch(given):
            rid = given.decode()
        else:
            rid = f"{self._prefix}-{next(self._ids)}"
            if given is not None:
                headers = [(k, v) for k, v in headers if k != _HEADER]
            elif not in_place:
                headers = list(headers)
            headers.append((_HEADER, rid.encode()))
            if in_place:
                scope["headers"] = headers
            else:
                scope = {**scope, "headers": headers}
        _current.set(rid)
        return scope, rid

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = _current.set(None)
        scope, rid = self.named(scope)
        encoded = rid.encode()

        async def send_with_id(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k != _HEADER]
                message["headers"] = [*kept, (_HEADER, encoded)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
