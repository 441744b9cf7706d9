"""The sends to one worker still waiting for their first byte.

Each send waits in a :class:`FirstByteWait`: a block that raises ``TimeoutError`` once the
wait is expired while it runs, as an ``asyncio.timeout`` block does, but with no loop timer,
no coroutine of its own and no deadline of its own: the proxy's one timer keeps every send's
deadline (:mod:`router.http.deadlines`) and expires the wait when it passes.

Each worker's entry in the registry owns one :class:`FirstByteWaits`; the proxy registers every
send's wait there, and the health poll ends them all at once when the worker stops answering,
so the requests retry elsewhere instead of waiting out their deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from types import TracebackType

__all__ = ["FirstByteWait", "FirstByteWaits"]


class FirstByteWait:
    """One send's wait for its first byte, in its task: ``with FirstByteWait() as wait:``.
    :meth:`expire` cancels the task; the block then raises ``TimeoutError`` in place of that
    cancellation, unless the task was also cancelled by someone else (then the
    ``CancelledError`` goes on), as ``asyncio.Timeout`` decides it.

    Args:
        task: the task the block runs in (None: the current one; a caller that knows it
            saves asking the loop, a system call).

    Raises:
        RuntimeError: made outside a task.
    """

    __slots__ = ("_cancelling", "_task", "expired")

    def __init__(self, task: asyncio.Task[object] | None = None) -> None:
        if task is None:
            task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a first-byte wait runs in a task")
        self._task = task
        self._cancelling = task.cancelling()
        #: :meth:`expire` was called.
        self.expired = False

    def __enter__(self) -> FirstByteWait:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if (self.expired and self._task.uncancel() <= self._cancelling
                and kind is asyncio.CancelledError):
            raise TimeoutError from error

    def expire(self) -> bool:
        """End the wait now (its block raises ``TimeoutError``); False when it was expired
        already. Call it only while the block runs (registered waits are, until their block
        forgets them)."""
        if self.expired:
            return False
        self.expired = True
        self._task.cancel()
        return True


class FirstByteWaits:
    """The sends to one worker still waiting for their first byte.

    :meth:`give_up` ends every such wait at once: each send then raises
    :class:`~router.http.proxy.UpstreamUnavailable` as if its deadline had passed, and its caller
    retries elsewhere. The health poll calls it when the worker stops answering.
    """

    def __init__(self) -> None:
        self._waits: set[FirstByteWait] = set()

    def __len__(self) -> int:
        return len(self._waits)

    @contextlib.contextmanager
    def waiting(self, wait: FirstByteWait) -> Iterator[None]:
        """Register ``wait`` (its block running) for the block's duration."""
        self._waits.add(wait)
        try:
            yield
        finally:
            self._waits.discard(wait)

    def add(self, wait: FirstByteWait) -> None:
        """Register ``wait`` until :meth:`discard` (:meth:`waiting` without the context
        manager's cost, for the proxy's hot path)."""
        self._waits.add(wait)

    def discard(self, wait: FirstByteWait) -> None:
        """Forget ``wait``."""
        self._waits.discard(wait)

    def give_up(self) -> int:
        """Expire every registered wait now; returns how many."""
        ended = 0
        for wait in list(self._waits):
            if wait.expire():
                ended += 1
        return ended
