"""The OpenAI-style API boundary shared by worker and router: request bodies and errors.

One shape for every refusal either app gives a client. Pure (no web framework): each HTTP app
turns :func:`error_body` into its JSON response.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

__all__ = ["MAX_BODY_BYTES", "ApiError", "check_bearer", "error_body", "parse_body",
           "wait_for_disconnect"]

MAX_BODY_BYTES = 64 * 1024 * 1024


class ApiError(Exception):
    """A request refused, with the HTTP status and OpenAI error type to send."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code


def error_body(error: ApiError) -> dict[str, Any]:
    """The JSON body OpenAI clients parse: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": error.message, "type": error.kind, "param": error.param,
                      "code": error.code or error.status}}


def parse_body(raw: bytes, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """Decode a request body that must be a JSON object.

    Raises:
        ApiError: 413 when over ``max_bytes``; 400 when not JSON or not an object.
    """
    if len(raw) > max_bytes:
        raise ApiError(413, f"the request body is over {max_bytes} bytes")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if type(body) is not dict:
        raise ApiError(400, "the body must be a JSON object")
    return body


def check_bearer(authorization: str | None, token: str | None) -> None:
    """Refuse a request whose ``Authorization`` header does not carry ``token``.

    No token configured means the endpoint is open (both apps bind 127.0.0.1 by default).

    Raises:
        ApiError: 401 when a token is configured and the header does not match it.
    """
    if token is None:
        return
    given = (authorization or "").encode()
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        raise ApiError(401, "this endpoint needs 'Authorization: Bearer <token>'",
                       "authentication_error")


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return when the ASGI client has gone away (call after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
