"""The proxy's first-byte deadlines, kept by one timer for every wait in flight.

An ``asyncio.timeout(seconds)`` per forwarded request arms a timer of the event loop and
cancels it again when the first byte comes, nearly always long before the deadline: a timer
handle made and dropped per request. :class:`Deadlines` keeps the deadline of each waiting
``asyncio.timeout(None)`` (entered unarmed) in a dict and arms one loop timer, for the
earliest deadline it has seen since it last fired; when that fires it expires every wait
past its deadline exactly as the wait's own timer would have (``Timeout.reschedule`` to now:
the waiting task is cancelled and its ``async with`` raises ``TimeoutError``), and arms
itself for the earliest left. A wait that ends first is only dropped from the dict.

A new deadline later than the one armed (the usual case: the same seconds counted from a
later start) costs a dict entry; an earlier one moves the timer. The timer fires at most once
per earliest deadline, so with waits of at least ``d`` seconds it looks through the waits in
flight at most once every ``d`` seconds. The waits stay plain ``asyncio.Timeout`` objects, so
:class:`~router.fleet.first_byte_waits.FirstByteWaits` can still end them early.
"""

from __future__ import annotations

import asyncio
import math

__all__ = ["Deadlines"]


class Deadlines:
    """Deadlines of entered, unarmed ``asyncio.Timeout`` waits, swept by one timer.

    Args:
        loop: the event loop the waits run on.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: dict[asyncio.Timeout, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf

    def __len__(self) -> int:
        return len(self._due)

    def add(self, timeout: asyncio.Timeout, seconds: float) -> None:
        """Expire ``timeout`` (entered, with no deadline of its own) ``seconds`` from now,
        unless :meth:`discard` comes first."""
        when = self._loop.time() + seconds
        self._due[timeout] = when
        if when < self._armed_at:
            self._arm(when)

    def discard(self, timeout: asyncio.Timeout) -> None:
        """Forget ``timeout`` (its wait ended)."""
        self._due.pop(timeout, None)

    def close(self) -> None:
        """Stop the timer; waits still registered keep no deadline."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_at = math.inf
        self._due.clear()

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_at = when
        self._timer = self._loop.call_at(when, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        self._armed_at = math.inf
        now = self._loop.time()
        due = self._due
        expired = [t for t, when in due.items() if when <= now]
        for timeout in expired:
            del due[timeout]
            if not timeout.expired():
                timeout.reschedule(now)
        if due:
            self._arm(min(due.values()))
