"""A deadline on reading a request body, wrapped around an ASGI app.

uvicorn bounds the wait for a request's headers (:mod:`httpapi.server` rule 2) but not for its
body: a client that sends one byte every few seconds holds its connection, its request slot
and its buffer for as long as it likes. :class:`BodyDeadline` bounds both ways of being slow:

1. the whole body must arrive within ``body_timeout`` seconds of the request's headers;
2. no pause between two pieces of it may last ``body_idle_timeout`` seconds.

Past either, the app's read of the body raises :class:`BodyTooSlow`, an
:class:`~openai_request.bodies.ApiError` that each app answers as any refusal: 408 with
``Connection: close``, so the rest of the upload is not waited for. Once the body is complete
the app's further reads (waiting for the client to leave) are not timed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from httpapi.body import CLOSE
from httpapi.refusals import count_refusal
from openai_request.bodies import ApiError

__all__ = ["BodyDeadline", "BodyTooSlow", "too_slow"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooSlow(ApiError):
    """A 408 whose connection is closed after the answer."""

    def __init__(self, message: str) -> None:
        super().__init__(408, message, code="request_timeout")
        self.headers = CLOSE


def too_slow(whole: bool, body_timeout: float, body_idle_timeout: float) -> BodyTooSlow:
    """Count and return the refusal of a body past rule 1's deadline (``whole``) or rule 2's."""
    count_refusal("body_timeout" if whole else "body_idle_timeout")
    return BodyTooSlow(f"the request body did not arrive within {body_timeout:g} s" if whole
                       else f"the request body paused for over {body_idle_timeout:g} s")


class BodyDeadline:
    """``app``, with the module's rules applied to every HTTP request's body.

    Args:
        app: the ASGI app.
        body_timeout: rule 1's seconds for the whole body.
        body_idle_timeout: rule 2's seconds between pieces.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, app: App, body_timeout: float, body_idle_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.body_timeout = body_timeout
        self.body_idle_timeout = body_idle_timeout
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = self.clock() + self.body_timeout
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            left = deadline - self.clock()
            if left <= 0:
                raise too_slow(True, self.body_timeout, self.body_idle_timeout)
            try:
                async with asyncio.timeout(min(left, self.body_idle_timeout)):
                    message = await receive()
            except TimeoutError:
                raise too_slow(left <= self.body_idle_timeout, self.body_timeout,
                               self.body_idle_timeout) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)
