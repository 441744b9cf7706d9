"""The prefill demand left after cache hits, against the fleet's prefill capacity: the signal
an autoscaler reads (``kvroute_prefill_demand_ratio``).

A routed request asks its worker to prefill ``n`` uncached tokens after ``c`` cached ones.
Under the routing core's rates (:mod:`router.routing.rates`) that costs
``n * prefill_s + context_s * n * (c + n / 2)`` seconds, so a worker prefills, per second,

    ``1 / (prefill_s + context_s * m)`` tokens, with ``m = (c + n / 2)`` averaged over tokens,

the context a prefilled token attends to in the traffic seen. :class:`PrefillDemand` keeps
two exponentially decaying rates, of ``n`` and of ``n * (c + n / 2)``, over one window; the
ratio of the tokens routed per second to the sum of the workers' capacities at the traffic's
``m`` is the share of the fleet's prefill time the traffic needs. At 1 the fleet is
prefilling all the time; a cache hit lowers the demand, a long context raises it.

:class:`DecayingRate` weighs an amount ``t`` seconds old by ``exp(-t / window)`` and divides
by the window, corrected in the first windows for the time it has run (so the rate of a
steady stream is that stream's from its first seconds, not a ramp).

Pure: the caller passes ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from router.routing.rates import Rates

__all__ = ["DecayingRate", "PrefillDemand"]


class DecayingRate:
    """Amount per second over an exponentially decaying window (module docstring).

    Args:
        window_s: the decay's time constant, in seconds.
        now: when it starts counting.

    Raises:
        ValueError: a window that is not positive and finite.
    """

    __slots__ = ("_at", "_start", "_sum", "window_s")

    def __init__(self, window_s: float, now: float) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError("window_s must be a positive finite number")
        self.window_s = window_s
        self._sum = 0.0
        self._at = self._start = now

    def _decay(self, now: float) -> None:
        if now > self._at:
            self._sum *= math.exp(-(now - self._at) / self.window_s)
            self._at = now

    def add(self, amount: float, now: float) -> None:
        """Count ``amount`` at ``now`` (a time before the last one counts as the last)."""
        self._decay(now)
        self._sum += amount

    def rate(self, now: float) -> float:
        """The amount per second at ``now``."""
        self._decay(now)
        ran = max(self._at - self._start, 0.0)
        # What a steady stream would have summed to by now, per unit rate.
        span = self.window_s * -math.expm1(-ran / self.window_s)
        return self._sum / span if span > 0 else 0.0


class PrefillDemand:
    """Uncached prompt tokens routed per second, and their share of the fleet's capacity.

    Args:
        window_s: the rates' window, in seconds.
        now: when it starts.
    """

    __slots__ = ("_context", "_tokens")

    def __init__(self, window_s: float, now: float) -> None:
        self._tokens = DecayingRate(window_s, now)
        self._context = DecayingRate(window_s, now)

    def routed(self, uncached: int, cached: int, now: float) -> None:
        """A request sent to prefill ``uncached`` tokens after ``cached`` ones."""
        if uncached <= 0:
            return
        self._tokens.add(uncached, now)
        self._context.add(uncached * (max(cached, 0) + uncached / 2), now)

    def tokens_per_second(self, now: float) -> float:
        """Uncached prompt tokens routed per second."""
        return self._tokens.rate(now)

    def mean_context(self, now: float) -> float:
        """The context an uncached token attended to, averaged over tokens (0: none seen)."""
        tokens = self._tokens.rate(now)
        return self._context.rate(now) / tokens if tokens > 0 else 0.0

    def capacity(self, rates: Iterable[Rates], now: float) -> float:
        """Tokens a second the workers of ``rates`` (per token) prefill at the traffic's mean
        context; a worker whose prefill costs nothing is left out (nothing to measure)."""
        context = self.mean_context(now)
        total = 0.0
        for r in rates:
            per_token = r.prefill_s + r.context_s * context
            if per_token > 0:
                total += 1.0 / per_token
        return total

    def ratio(self, rates: Iterable[Rates], now: float) -> float:
        """Uncached tokens routed per second over :meth:`capacity` (0 with no capacity)."""
        capacity = self.capacity(rates, now)
        return self.tokens_per_second(now) / capacity if capacity > 0 else 0.0
