"""A request body read from the client while it may already be on its way to a worker.

The router decides a long prompt before its body ends when it can (:mod:`openai_request.early_body`
says when), then sends the body upstream as it arrives. :class:`IncomingBody` is the one
reader of the body on the ASGI channel, before and after that decision:

1. the same limits as a buffered read (:func:`httpapi.body.receive_body`): a declared length
   over the limit is refused before any byte is read (413), a body counted past it while it
   arrives is refused then (413); the body deadlines (408) come from the ASGI channel itself
   (:class:`httpapi.deadlines.BodyDeadline`); a client that leaves mid-body is
   :class:`~httpapi.body.ClientGone`;
2. every chunk is kept until the request ends, so :meth:`IncomingBody.chunks` replays the
   body from its first byte for each worker tried (a failover before the first byte resends
   what arrived, then follows what is still to come), and the worker receives the client's
   bytes exactly;
3. once sending has begun, :meth:`IncomingBody.pump` reads the rest in a task of its own and
   then waits for the client to leave, as the buffered path's watcher does. A failure of the
   body after that point never ends the upstream body as if complete: :meth:`chunks` stops
   there and waits, and the handler, cancelled by the pump's end, answers the failure;
4. a body decided before its end is given :attr:`IncomingBody.check`, which the whole body
   must pass before its last piece is kept: a refusal there (a 400) is such a failure, so
   the worker never receives a complete body the router would have refused whole.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from httpapi.body import BodyTooLarge, ClientGone, check_declared, wait_for_disconnect

__all__ = ["IncomingBody"]

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class IncomingBody:
    """One request's body as it arrives (rules in the module docstring).

    Args:
        receive: the ASGI receive channel.
        declared: the request's ``Content-Length``, if it has one.
        max_bytes: the body's limit.

    Raises:
        ApiError: 413 when ``declared`` is over ``max_bytes``; 400 when it is not a number.

    Attributes:
        declared: the declared length, as a number, or ``None``.
        size: bytes read so far.
        complete: the last byte arrived.
        completed_at: when it did (``time.monotonic``), or ``None``.
        failure: what ended the body early (:class:`ClientGone`, a 413 or a 408, or what
            :attr:`check` raised), or ``None``.
        check: called with the whole body before its last piece is kept (rule 4); it raises
            to refuse the body, else returns what it read of it. ``None``: no check.
        checked: what :attr:`check` returned (the parsed body), or ``None``.
    """

    def __init__(self, receive: Receive, declared: str | None, max_bytes: int) -> None:
        self.declared = check_declared(declared, max_bytes)
        self._receive = receive
        self._max_bytes = max_bytes
        self._chunks: list[bytes] = []
        # Made when something waits for the body to grow (a body that came whole never is).
        self._grew: asyncio.Event | None = None
        self.size = 0
        self.complete = False
        self.completed_at: float | None = None
        self.failure: Exception | None = None
        self.check: Callable[[bytes], Any] | None = None
        self.checked: Any = None

    async def read_more(self) -> bytes:
        """Read the next piece of the body and return it (``b""`` once complete).

        Raises:
            ApiError: 413, the body passed the limit; the channel's 408; what :attr:`check`
                raised.
            ClientGone: the client left.
        """
        if self.complete:
            return b""
        try:
            message = await self._receive()
            if message["type"] != "http.request":  # http.disconnect
                raise ClientGone
            chunk = message.get("body", b"")
            self.size += len(chunk)
            if self.size > self._max_bytes:
                raise BodyTooLarge(self._max_bytes)
            if self.check is not None and not message.get("more_body", False):
                self.checked = self.check(b"".join((*self._chunks, chunk)))
        except Exception as exc:
            self.failure = exc
            self._wake()
            raise
        if chunk:
            self._chunks.append(chunk)
        if not message.get("more_body", False):
            self.complete = True
            self.completed_at = time.monotonic()
        self._wake()
        return chunk

    def whole(self) -> bytes:
        """The complete body (call once :attr:`complete`)."""
        assert self.complete, "whole() before the body's end"
        chunks = self._chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def pump(self) -> None:
        """Read the rest of the body, then return when the client leaves (rule 3).

        Raises:
            ApiError: as :meth:`read_more`.
            ClientGone: the client left before the body's end.
        """
        while not self.complete:
            await self.read_more()
        await wait_for_disconnect(self._receive)

    async def ended(self) -> None:
        """Return at the body's end; at a failure, wait for the handler to be cancelled."""
        async for _ in self.chunks():
            pass

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body from its first byte, following it as it arrives (rule 2); waits, without
        end, at a failure, for the handler to be cancelled."""
        sent = 0
        while True:
            grew = self._grew
            if grew is None:
                grew = self._grew = asyncio.Event()
            while sent < len(self._chunks):
                yield self._chunks[sent]
                sent += 1
            if self.complete:
                return
            await grew.wait()

    def _wake(self) -> None:
        grew = self._grew
        if grew is not None:
            self._grew = None
            grew.set()
