"""The sends to one worker still waiting for their first byte.

Each worker's entry in the registry owns one :class:`FirstByteWaits`; the proxy registers every
send's deadline there, and the health poll ends them all at once when the worker stops
answering, so the requests retry elsewhere instead of waiting out their deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

__all__ = ["FirstByteWaits"]


class FirstByteWaits:
    """The sends to one worker still waiting for their first byte.

    :meth:`give_up` ends every such wait at once: each send then raises
    :class:`~router.http.proxy.UpstreamUnavailable` as if its deadline had passed, and its caller
    retries elsewhere. The health poll calls it when the worker stops answering.
    """

    def __init__(self) -> None:
        self._waits: set[asyncio.Timeout] = set()

    def __len__(self) -> int:
        return len(self._waits)

    @contextlib.contextmanager
    def waiting(self, timeout: asyncio.Timeout) -> Iterator[None]:
        """Register ``timeout`` (an entered ``asyncio.timeout``) for the block's duration."""
        self._waits.add(timeout)
        try:
            yield
        finally:
            self._waits.discard(timeout)

    def add(self, timeout: asyncio.Timeout) -> None:
        """Register ``timeout`` until :meth:`discard` (:meth:`waiting` without the context
        manager's cost, for the proxy's hot path)."""
        self._waits.add(timeout)

    def discard(self, timeout: asyncio.Timeout) -> None:
        """Forget ``timeout``."""
        self._waits.discard(timeout)

    def give_up(self) -> int:
        """Expire every registered wait now; returns how many."""
        now = asyncio.get_running_loop().time()
        ended = 0
        for timeout in list(self._waits):
            if not timeout.expired():
                timeout.reschedule(now)
                ended += 1
        return ended
