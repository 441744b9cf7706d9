"""How long the router waits for a request's first byte: what it expects the worker to need.

A worker that takes a request and then stops (paused, wedged, swapping) gives no error; the
only sign is time. Waiting the proxy's ceiling (minutes) strands the request; waiting a fixed
few seconds gives up on long prefills that are merely slow. So the deadline follows the
request: per worker, the clock learns the seconds a block of queued prefill takes before a
stream's first chunk, and a request's deadline is ``factor`` times that rate times the prefill
blocks queued there with it (the load books' ``pending_prefill_blocks``), never below
``floor`` nor above ``ceiling``.

The rate rises at once to a slower sample and falls slowly (a tenth of the way per sample), so one
fast burst does not make the next slow prefill look hung. Until a worker's first stream, its rate is
``PRIOR_S_PER_BLOCK``, slower than any GPU engine's prefill. A whole (non-stream) answer, whose
first byte comes only after its last token, waits the ceiling; the health poll still frees it from a
worker that stops answering (:class:`~router.fleet.first_byte_waits.FirstByteWaits`).

Pure: the caller passes the elapsed seconds.
"""

from __future__ import annotations

__all__ = ["PRIOR_S_PER_BLOCK", "FirstByteClock"]

#: The weight of a faster sample in the learned rate (a slower one replaces it).
_FALL = 0.1
#: Seconds per block of prefill assumed before a worker's first stream: 50 ms (640 tokens a
#: second at 32 tokens a block), several times slower than a GPU engine's prefill.
PRIOR_S_PER_BLOCK = 0.05


class FirstByteClock:
    """Per worker, learned seconds per queued prefill block before a first byte.

    Args:
        floor: the shortest deadline, seconds.
        factor: the deadline is this many times the expected time.
        ceiling: the longest deadline (the proxy's first-byte timeout).
    """

    def __init__(self, floor: float, factor: float, ceiling: float) -> None:
        if not 0 < floor <= ceiling or factor < 1:
            raise ValueError("need 0 < floor <= ceiling and factor >= 1")
        self.floor = floor
        self.factor = factor
        self.ceiling = ceiling
        self._rate: dict[int, float] = {}

    def deadline(self, worker: int, blocks_ahead: float) -> float:
        """Seconds to wait for the first byte of a stream sent to ``worker`` with
        ``blocks_ahead`` blocks of prefill queued there (its own included)."""
        expected = self._rate.get(worker, PRIOR_S_PER_BLOCK) * max(blocks_ahead, 1.0)
        return min(self.ceiling, max(self.floor, self.factor * expected))

    def observed(self, worker: int, blocks_ahead: float, seconds: float) -> None:
        """A stream sent with ``blocks_ahead`` queued blocks began after ``seconds``."""
        sample = max(seconds, 0.0) / max(blocks_ahead, 1.0)
        rate = self._rate.get(worker)
        self._rate[worker] = sample if rate is None or sample > rate else (
            rate + _FALL * (sample - rate))

    def rate(self, worker: int) -> float | None:
        """The learned seconds per block on ``worker`` (None before its first stream)."""
        return self._rate.get(worker)

    def forget(self, worker: int) -> None:
        """Drop what was learned about ``worker`` (removed)."""
        self._rate.pop(worker, None)
