"""The proxy's shared first-byte deadlines: one timer, armed for the earliest deadline, expires
exactly the waits past theirs and moves on to the earliest left. The loop's clock and timer are
a fake the test moves by hand, so no test waits out a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from router.fleet.first_byte_waits import FirstByteWait, FirstByteWaits
from router.http.deadlines import Deadlines


class _Handle:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class _Clock:
    """The two loop methods :class:`Deadlines` uses: a clock set by hand, timers fired by
    hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.handles: list[_Handle] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        self.handles.append(_Handle(when, callback))
        return self.handles[-1]

    def armed(self) -> list[float]:
        return [h.when for h in self.handles if not h.cancelled]

    def fire(self) -> None:
        """Move the clock to the armed timer and run it."""
        (handle,) = [h for h in self.handles if not h.cancelled]
        handle.cancelled = True
        self.now = handle.when
        handle.callback()


async def _wait(deadlines: Deadlines, seconds: float, waits: FirstByteWaits | None = None
                ) -> str:
    with FirstByteWait() as wait:
        deadlines.add(wait, seconds)
        if waits is not None:
            waits.add(wait)
        try:
            await asyncio.Event().wait()
        finally:
            deadlines.discard(wait)
            if waits is not None:
                waits.discard(wait)
    return "answered"


async def _settle() -> None:
    for _ in range(5):  # a timeout's cancellation takes a loop turn or two
        await asyncio.sleep(0)


async def test_one_timer_expires_exactly_the_waits_past_their_deadline() -> None:
    clock = _Clock()
    deadlines = Deadlines(clock)  # type: ignore[arg-type]
    a = asyncio.create_task(_wait(deadlines, 5.0))
    b = asyncio.create_task(_wait(deadlines, 9.0))
    c = asyncio.create_task(_wait(deadlines, 7.0))
    await _settle()
    assert clock.armed() == [5.0], "one timer, at the earliest deadline"
    clock.fire()
    await _settle()
    assert a.done() and isinstance(a.exception(), TimeoutError)
    assert not b.done() and not c.done()
    assert clock.armed() == [7.0] and len(deadlines) == 2
    c.cancel()  # ends before its deadline: only forgotten
    await _settle()
    assert c.cancelled() and len(deadlines) == 1
    clock.fire()  # c's deadline passes with nothing due: on to b's
    await _settle()
    assert not b.done() and clock.armed() == [9.0]
    d = asyncio.create_task(_wait(deadlines, 1.0))  # earlier than the one armed: moves it
    await _settle()
    assert clock.armed() == [8.0]
    clock.fire()
    await _settle()
    assert isinstance(d.exception(), TimeoutError) and not b.done()
    assert clock.armed() == [9.0]
    clock.fire()
    await _settle()
    assert isinstance(b.exception(), TimeoutError)
    assert clock.armed() == [] and len(deadlines) == 0


async def test_a_later_deadline_keeps_the_timer_and_the_health_poll_still_gives_up() -> None:
    clock = _Clock()
    deadlines = Deadlines(clock)  # type: ignore[arg-type]
    waits = FirstByteWaits()
    first = asyncio.create_task(_wait(deadlines, 300.0, waits))
    await _settle()
    clock.now = 10.0
    later = asyncio.create_task(_wait(deadlines, 300.0, waits))
    await _settle()
    assert clock.armed() == [300.0] and len(clock.handles) == 1
    assert waits.give_up() == 2  # the worker stopped answering: both end now
    await _settle()
    for task in (first, later):
        assert isinstance(task.exception(), TimeoutError)
    assert len(deadlines) == 0 and len(waits) == 0
    clock.fire()  # the deadline passes with nothing left
    assert clock.armed() == []


async def test_closing_stops_the_timer() -> None:
    clock = _Clock()
    deadlines = Deadlines(clock)  # type: ignore[arg-type]
    task = asyncio.create_task(_wait(deadlines, 5.0))
    await _settle()
    deadlines.close()
    assert clock.armed() == [] and len(deadlines) == 0
    task.cancel()
    await _settle()
    assert task.cancelled()
