"""Whether a worker whose health probe came back late is alive: probes and the data path.

A probe with no answer within ``health_timeout`` is weak evidence on its own: a worker at its
limit answers its streams and queues its ``/load``. Taking it out of the candidate set on one
late probe fails requests that were making progress and moves the load onto the other workers,
which are at their limit too. So :class:`Liveness` weighs two kinds of evidence:

1. A probe answered: the worker is alive; the count of misses starts again.
2. A probe found no connection (refused, reset): the worker is gone at once. The registry
   decides this one from the error; it never reaches this class.
3. A probe came back late: when the data path received a byte from the worker within
   ``window`` seconds (the registry gives the probe's timeout: bytes that came while the probe
   waited, from a stream or an answer in progress there), the worker is alive and the miss is
   excused; otherwise it is a miss, and ``misses`` of them in a row mean it is gone. A paused
   or hung worker sends nothing while its probe waits, so it is gone after ``misses`` probes,
   as soon as its first late probe would have found it if it had no streams.

The clock is injected; nothing here waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

__all__ = ["Liveness", "Verdict"]

Verdict = Literal["excused", "missed", "gone"]


class Liveness:
    """One worker's evidence of life (module docstring for the rules).

    Args:
        misses: late probes in a row, with no byte on the data path, that mean the worker
            is gone.
        window: seconds a byte on the data path counts as evidence of life.
        clock: seconds, monotonic.
    """

    def __init__(self, misses: int = 2, window: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert misses >= 1, "a worker must be allowed at least one miss"
        self.misses_allowed = misses
        self.window = window
        self.clock = clock
        #: Late probes in a row that nothing excused.
        self.misses = 0
        self._last_progress: float | None = None

    def progressed(self) -> None:
        """The data path received bytes from the worker now."""
        self._last_progress = self.clock()

    def answered(self) -> None:
        """A probe was answered (rule 1)."""
        self.misses = 0

    def late(self) -> Verdict:
        """A probe came back late (rule 3): ``"excused"`` (the data path shows the worker
        alive; misses start again), ``"missed"`` (one more miss, not yet enough), or
        ``"gone"`` (``misses`` in a row)."""
        last = self._last_progress
        if last is not None and self.clock() - last <= self.window:
            self.misses = 0
            return "excused"
        self.misses += 1
        return "gone" if self.misses >= self.misses_allowed else "missed"
