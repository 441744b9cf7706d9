"""Reading a request body within a byte limit, and noticing a client that went away.

Starlette's ``Request.body()`` holds the whole body before anyone can look at its size; these
helpers enforce the limit while reading instead:

1. a ``Content-Length`` over the limit is refused (413) before any of the body is read;
2. a chunked (or lying) body is counted as it arrives and refused as soon as it passes the
   limit, so at most ``max_bytes`` plus one network read is ever held;
3. a refused body's connection is closed (``Connection: close``), so the rest of an upload is
   not read only to be thrown away;
4. a client that leaves mid-body raises :class:`ClientGone`, which the apps count and answer
   without a traceback (nobody is left to read the answer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request

from openai_request.bodies import ApiError, parse_body

__all__ = ["TOKENIZE_OFF_LOOP_BYTES", "BodyTooLarge", "ClientGone", "check_declared", "read_body",
           "read_json", "receive_body", "wait_for_disconnect"]

#: The ASGI receive channel.
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

#: A request body larger than this has its prompt encoded in a worker thread rather than on
#: the event loop, which would otherwise stall every other request while it runs (encoding is
#: about 10-100 ns a byte).
TOKENIZE_OFF_LOOP_BYTES = 256 * 1024

#: The header a 413 carries (rule 3).
CLOSE = {"connection": "close"}


class ClientGone(Exception):
    """The client closed its connection before the request was answered."""


class BodyTooLarge(ApiError):
    """A 413 whose connection is closed after the answer (rule 3)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is over {max_bytes} bytes",
                         code="request_too_large")
        self.headers = CLOSE


async def read_body(request: Request, max_bytes: int) -> bytes:
    """Return the request body, refusing it once it passes ``max_bytes`` (rules 1 and 2).

    Raises:
        ApiError: 413 (a :class:`BodyTooLarge`) when the body is larger than ``max_bytes``;
            400 when ``Content-Length`` is not a number.
        ClientGone: the client left before the body was complete.
    """
    return await receive_body(request.headers.get("content-length"), request.receive,
                              max_bytes)


async def receive_body(declared: str | None, receive: Receive, max_bytes: int) -> bytes:
    """:func:`read_body` on the ASGI ``receive`` channel itself, for a raw ASGI route;
    ``declared`` is the request's ``Content-Length``, if it has one.

    Raises:
        ApiError: as :func:`read_body`.
        ClientGone: as :func:`read_body`.
    """
    check_declared(declared, max_bytes)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def check_declared(declared: str | None, max_bytes: int) -> int | None:
    """Rule 1: the declared ``Content-Length`` as a number (``None`` when there is none).

    Raises:
        ApiError: 413 (a :class:`BodyTooLarge`) when it is over ``max_bytes``; 400 when it is
            not a number.
    """
    if declared is None:
        return None
    if not declared.isdigit():
        raise ApiError(400, "Content-Length is not a number")
    if int(declared) > max_bytes:
        raise BodyTooLarge(max_bytes)
    return int(declared)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """Return the request body decoded as a JSON object (:func:`read_body`, then
    :func:`openai_request.bodies.parse_body`).

    Raises:
        ApiError: 413 when too large; 400 when not a JSON object.
        ClientGone: the client left before the body was complete.
    """
    return parse_body(await read_body(request, max_bytes), max_bytes)


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI client has gone away (call after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
