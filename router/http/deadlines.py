"""The proxy's first-byte deadlines, kept by one timer for every wait in flight.

An ``asyncio.timeout(seconds)`` per forwarded request arms a timer of the event loop and
cancels it again when the first byte comes, nearly always long before the deadline: a timer
handle made and dropped per request. :class:`Deadlines` keeps the deadline of each waiting
:class:`~router.fleet.first_byte_waits.FirstByteWait` in a dict and arms one loop timer, for
the earliest deadline it has seen since it last fired; when that fires it expires every wait
past its deadline (the waiting task is cancelled and its block raises ``TimeoutError``, as an
``asyncio.timeout`` block would), and arms itself for the earliest left. A wait that ends
first is only dropped from the dict.

A new deadline later than the one armed (the usual case: the same seconds counted from a
later start) costs a dict entry; an earlier one moves the timer. The timer fires at most once
per earliest deadline, so with waits of at least ``d`` seconds it looks through the waits in
flight at most once every ``d`` seconds. The worker's
:class:`~router.fleet.first_byte_waits.FirstByteWaits` can end the same waits early.
"""

from __future__ import annotations

import asyncio
import math

from router.fleet.first_byte_waits import FirstByteWait

__all__ = ["Deadlines"]


class Deadlines:
    """Deadlines of first-byte waits whose block runs, swept by one timer.

    Args:
        loop: the event loop the waits run on.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: dict[FirstByteWait, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf

    def __len__(self) -> int:
        return len(self._due)

    def add(self, wait: FirstByteWait, seconds: float) -> None:
        """Expire ``wait`` (its block running) ``seconds`` from now, unless :meth:`discard`
        comes first."""
        when = self._loop.time() + seconds
        self._due[wait] = when
        if when < self._armed_at:
            self._arm(when)

    def discard(self, wait: FirstByteWait) -> None:
        """Forget ``wait`` (it ended)."""
        self._due.pop(wait, None)

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
        expired = [w for w, when in due.items() if when <= now]
        for wait in expired:
            del due[wait]
            wait.expire()
        if due:
            self._arm(min(due.values()))
