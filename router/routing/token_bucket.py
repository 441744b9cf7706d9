"""A token bucket: a rate of prompt tokens per minute, with a minute's worth of burst.

A bucket holds at most ``capacity`` tokens and fills at ``rate_per_s``; a request takes its
prompt's tokens from it at once, or is told how long until the bucket holds that many. A
request larger than the whole bucket can never pass (:meth:`TokenBucket.take` says so with
``math.inf``), so the caller refuses it instead of asking it to retry.

Invariants:
    1. ``0 <= level <= capacity`` after every call.
    2. A refused take leaves the bucket as it was, but for the refill up to ``now``.
    3. Time that runs backwards (a clock read out of order) adds nothing.

Pure: the caller passes ``now``.
"""

from __future__ import annotations

import math

__all__ = ["TokenBucket"]


class TokenBucket:
    """Tokens per second with a burst of ``capacity`` (module docstring); it starts full.

    Args:
        rate_per_s: tokens added a second.
        capacity: tokens held at most.
        now: the time it starts at.

    Raises:
        ValueError: a rate or capacity that is not a positive finite number.
    """

    __slots__ = ("_at", "capacity", "level", "rate_per_s")

    def __init__(self, rate_per_s: float, capacity: float, now: float) -> None:
        if not (rate_per_s > 0 and capacity > 0 and math.isfinite(rate_per_s)
                and math.isfinite(capacity)):
            raise ValueError("rate_per_s and capacity must be positive finite numbers")
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self.level = capacity
        self._at = now

    @classmethod
    def per_minute(cls, tokens_per_minute: int, now: float) -> TokenBucket:
        """A bucket of ``tokens_per_minute``, holding a minute's worth."""
        return cls(tokens_per_minute / 60.0, float(tokens_per_minute), now)

    def _refill(self, now: float) -> None:
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate_per_s)
            self._at = now

    def take(self, tokens: float, now: float) -> float:
        """Take ``tokens`` at ``now``.

        Returns:
            0.0 when they were taken; else the seconds until the bucket holds them (nothing
            taken), ``math.inf`` when it never will (more than its capacity).
        """
        self._refill(now)
        if tokens <= self.level:
            self.level -= max(tokens, 0.0)
            return 0.0
        if tokens > self.capacity:
            return math.inf
        return (tokens - self.level) / self.rate_per_s

    def remaining(self, now: float) -> float:
        """Tokens the bucket holds at ``now``."""
        self._refill(now)
        return self.level
