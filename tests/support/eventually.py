"""Bounded waits: poll a probe until its value satisfies a condition, or fail saying what.

One way to wait for another task, thread or process in every test (``tests/`` and ``e2e/``):
a test cannot await a state change across a socket, so it polls, with a deadline generous
enough for a loaded machine. The deadline bounds the wait; it is never the thing tested (a test
that needs "how long" drives an injected clock instead). The failure names what was awaited and
the last value seen (or the last error the probe raised, when ``tolerate`` lets it retry).

:func:`eventually` is for coroutines (the probe may be a coroutine function); passing ``wake``
(an :class:`asyncio.Event` set on every change) re-checks at each change instead of polling.
:func:`eventually_blocking` is the same wait for plain threads (e2e's processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["DEFAULT_TIMEOUT", "eventually", "eventually_blocking"]

T = TypeVar("T")

#: Seconds a wait lasts at most unless told otherwise: long enough for 2 busy cores.
DEFAULT_TIMEOUT = 10.0


def _failure(what: str, timeout: float, last: Any, error: BaseException | None) -> AssertionError:
    seen = f"last error {error!r}" if error is not None else f"last value {last!r}"
    return AssertionError(f"timed out after {timeout:g}s waiting for {what} ({seen})"[:4000])


async def eventually(probe: Callable[[], T | Awaitable[T]], what: str,
                     timeout: float = DEFAULT_TIMEOUT, *, until: Callable[[T], Any] = bool,
                     interval: float = 0.02, wake: asyncio.Event | None = None,
                     tolerate: tuple[type[BaseException], ...] = ()) -> T:
    """Await ``probe()`` until ``until(value)`` holds; return that value.

    Args:
        probe: returns (or, as a coroutine function, resolves to) the value to test.
        what: what is awaited, for the failure message.
        timeout: seconds at most.
        until: the condition on the probe's value (by default: the value is truthy).
        interval: seconds between probes when no ``wake`` event is given.
        wake: an event set whenever the probed state changes; the wait clears it before each
            probe and sleeps until it is set again.
        tolerate: exceptions from the probe that mean "not yet" rather than failure.

    Raises:
        AssertionError: the condition did not hold within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    error: BaseException | None = None
    while True:
        if wake is not None:
            wake.clear()
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
            last, error = value, None
            if until(value):
                return value  # type: ignore[return-value]
        except tolerate as exc:
            error = exc
        left = deadline - time.monotonic()
        if left <= 0:
            raise _failure(what, timeout, last, error)
        if wake is None:
            await asyncio.sleep(min(interval, left))
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), left)


def eventually_blocking(probe: Callable[[], T], what: str, timeout: float = DEFAULT_TIMEOUT,
                        *, until: Callable[[T], Any] = bool, interval: float = 0.02,
                        tolerate: tuple[type[BaseException], ...] = ()) -> T:
    """:func:`eventually` for a plain thread: call ``probe()`` until ``until(value)`` holds.

    Raises:
        AssertionError: the condition did not hold within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    error: BaseException | None = None
    while True:
        try:
            value = probe()
            last, error = value, None
            if until(value):
                return value
        except tolerate as exc:
            error = exc
        left = deadline - time.monotonic()
        if left <= 0:
            raise _failure(what, timeout, last, error)
        time.sleep(min(interval, left))
