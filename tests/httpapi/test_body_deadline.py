"""The body read deadline around an ASGI app, driven by a clock the test moves: the whole
body's deadline and the pause between pieces, and no deadline once the body is complete."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest

from httpapi.deadlines import BodyDeadline, BodyTooSlow
from httpapi.refusals import refusals

Message = MutableMapping[str, Any]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def read_all(scope: Message, receive: Any, send: Any) -> None:
    """An app that reads the body to its end, then waits once more (for a disconnect)."""
    while (await receive()).get("more_body"):
        pass
    await receive()


async def run(app: BodyDeadline, pieces: list[tuple[float, Message]]) -> None:
    """Run ``app`` on a request whose ``receive`` returns each piece after moving the clock
    on by the piece's seconds; past the pieces it waits forever."""
    clock = app.clock
    assert isinstance(clock, Clock)
    queue = list(pieces)

    async def receive() -> Message:
        if not queue:
            await asyncio.Event().wait()
        seconds, message = queue.pop(0)
        clock.now += seconds
        return message

    async def send(_: Message) -> None:
        raise AssertionError("nothing is sent")

    await app({"type": "http"}, receive, send)


def piece(more: bool) -> Message:
    return {"type": "http.request", "body": b"x", "more_body": more}


async def test_a_body_arriving_steadily_past_its_whole_deadline_is_refused() -> None:
    app = BodyDeadline(read_all, body_timeout=10, body_idle_timeout=5, clock=Clock())
    before = refusals("body_timeout")
    # Each piece comes 4 s after the last: never a pause over 5 s, but the third read
    # begins 12 s after the headers.
    with pytest.raises(BodyTooSlow, match="within 10 s") as refused:
        await run(app, [(4, piece(True)), (4, piece(True)), (4, piece(True)),
                        (4, piece(False))])
    assert refused.value.status == 408
    assert refused.value.headers == {"connection": "close"}
    assert refusals("body_timeout") == before + 1


async def test_a_pause_between_pieces_past_the_idle_deadline_is_refused() -> None:
    app = BodyDeadline(read_all, body_timeout=60, body_idle_timeout=0.01, clock=Clock())
    before = refusals("body_idle_timeout")
    with pytest.raises(BodyTooSlow, match=r"paused for over 0\.01 s"):
        await run(app, [(1, piece(True))])  # then nothing
    assert refusals("body_idle_timeout") == before + 1


async def test_a_complete_body_is_not_timed_afterwards() -> None:
    app = BodyDeadline(read_all, body_timeout=10, body_idle_timeout=5, clock=Clock())
    disconnect = {"type": "http.disconnect"}
    # The body ends at 8 s; the wait for the client to leave lasts until 1000 s.
    await run(app, [(4, piece(True)), (4, piece(False)), (992, disconnect)])
