"""Eviction pressure: how fast the cluster's device caches are turning over, and the queue
weight that follows from it.

The signal, from the workers' normalised KV events (:mod:`indexer.events`) alone::

    pressure(now) = device blocks removed, all workers, in the last ``window_s`` seconds
                    / sum over workers of the most device blocks each has held at once

The denominator is each worker's peak resident count (stored minus removed, as a consumer of
its events sees it): once a cache has filled that is its capacity, learned without asking the
engine. So the pressure is the share of the cluster's cache evicted in the window. It
separates the benchmark's workloads cleanly (``docs/benchmarks.md``): median about 0.56-0.70
on the synthetic trace at 0.5M tokens per worker, about 0.01 at 2M, 0 on the generators.

The rule (:func:`queue_weight_for`): the scheduler's queue weight is ``high_pressure_weight``
(0.10) at pressure >= ``high`` (0.7), ``low_pressure_weight`` (0.25) at pressure <= ``low``
(0.3), linear between. Why: the queue weight prices waiting behind a worker's queued prefill
against recomputing a prefix elsewhere. A recompute costs the cluster the work *and* a second
copy of the prefix, which evicts something else; when caches churn (high pressure), that
duplicate evicts blocks that other requests were about to hit, so waiting is worth more and
the weight drops. When caches are roomy a duplicate is nearly free and the queue counts
more. Paired with a cap on the discounted queue
(:attr:`router.scheduler.SchedulerConfig.queue_cap_blocks`: only a queue's first blocks past
the shortest queue in the cluster are discounted, the rest count at 1.0) so a low weight
cannot pile a hot prefix's traffic behind one worker without bound.

Status: measured on ``bench.replay`` over several seeds (``docs/benchmarks.md``, last
section). Alone (the defaults here, "rule K") it meets the hit-rate target at 0.5M tokens per
worker where a fixed 0.5 does not, but at zero pressure its 0.25 weight blew up
``multi_turn``'s TTFT p99 at two of five seeds. The router's default
(:data:`ROUTER_PRESSURE_RULE`, ``--queue-weight auto``) therefore keeps 0.5 while the caches
warm up (:meth:`EvictionPressure.warming`) and applies K once they have evicted or are half
full.

Pure: the caller passes ``now`` (seconds, any monotonic origin) with every call. No I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from indexer.events import Cleared, Event, Removed, Stored, Tier, tier_of

__all__ = ["AUTO_QUEUE_CAP_BLOCKS", "ROUTER_PRESSURE_RULE", "EvictionPressure", "PressureRule",
           "queue_terms_for", "queue_weight_for"]


class EvictionPressure:
    """Device blocks removed in a sliding window over the cluster's peak resident blocks.

    Feed it each worker's normalised events as they arrive (:meth:`observe`), or counts of
    blocks stored and removed (:meth:`record`). Only the device tier counts (events whose
    ``medium`` is absent or a device name, :func:`indexer.events.tier_of`); host-tier stores
    and removals are ignored.

    Args:
        window_s: seconds of removals that count (default 10).

    Raises:
        ValueError: a non-positive window.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._resident: dict[int, int] = {}
        self._peak: dict[int, int] = {}
        self._removals: deque[tuple[float, int]] = deque()  # (time, blocks), oldest first
        self._removed_in_window = 0
        self._warmed = False  # a device block was evicted, or the caches were found full enough

    def observe(self, worker: int, events: Iterable[Event], now: float) -> None:
        """Account one batch of ``worker``'s events received at ``now``, in order."""
        for e in events:
            if isinstance(e, Stored):
                if tier_of(e.medium) == Tier.DEVICE:
                    self._store(worker, len(e.block_hashes))
            elif isinstance(e, Removed):
                if tier_of(e.medium) == Tier.DEVICE:
                    self._remove(worker, len(e.block_hashes), now)
            elif isinstance(e, Cleared):
                # A restart or reset, not eviction: nothing resident, no removals counted.
                self._resident[worker] = 0
                if self._warmed and not any(self._resident.values()):
                    self._warmed = False  # every cache is empty again: a cold cluster
        self._prune(now)

    def record(self, worker: int, stored: int, removed: int, now: float) -> None:
        """Account ``stored`` and ``removed`` device blocks on ``worker`` at ``now``.

        Removals are applied before stores (an engine frees blocks before it fills them); the
        resident count never goes below zero (blocks stored before the router listened).

        Raises:
            ValueError: a negative count.
        """
        if stored < 0 or removed < 0:
            raise ValueError("stored and removed must be >= 0")
        self._remove(worker, removed, now)
        self._store(worker, stored)
        self._prune(now)

    def _store(self, worker: int, blocks: int) -> None:
        resident = self._resident.get(worker, 0) + blocks
        self._resident[worker] = resident
        if resident > self._peak.get(worker, 0) or worker not in self._peak:
            self._peak[worker] = resident

    def _remove(self, worker: int, blocks: int, now: float) -> None:
        self._resident[worker] = max(self._resident.get(worker, 0) - blocks, 0)
        self._peak.setdefault(worker, 0)
        if blocks:
            self._removals.append((now, blocks))
            self._removed_in_window += blocks
            self._warmed = True

    def forget(self, worker: int) -> None:
        """Drop a worker's resident and peak counts (it left the cluster). Its removals already
        in the window stay until they age out."""
        self._resident.pop(worker, None)
        self._peak.pop(worker, None)

    def warming(self, capacity_blocks: float, fill: float) -> bool:
        """True until the first device eviction and while the resident blocks are under
        ``fill`` x ``capacity_blocks`` (the workers' device blocks; 0 = unknown, then only an
        eviction ends it). Once over, it stays over: a cache that filled once is in the
        regime the pressure rule is for; one worker's restart does not change that. Only a
        reset that leaves every worker's cache empty (each has sent ``Cleared`` and stored
        nothing since) starts the warm-up again, as on a fresh cluster."""
        if not self._warmed and capacity_blocks > 0:
            self._warmed = sum(self._resident.values()) >= fill * capacity_blocks
        return not self._warmed

    def pressure(self, now: float) -> float:
        """Blocks removed in ``(now - window_s, now]`` over the sum of peak resident blocks;
        0.0 before any worker has held a block."""
        self._prune(now)
        capacity = sum(self._peak.values())
        return self._removed_in_window / capacity if capacity > 0 else 0.0

    def resident(self, worker: int) -> int:
        """Device blocks ``worker`` holds as its events say."""
        return self._resident.get(worker, 0)

    def peak(self, worker: int) -> int:
        """The most device blocks ``worker`` has held at once."""
        return self._peak.get(worker, 0)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        q = self._removals
        while q and q[0][0] <= horizon:
            self._removed_in_window -= q.popleft()[1]


class PressureRule:
    """The pressure -> queue weight mapping's parameters (see :func:`queue_weight_for`).

    Args:
        low: pressure at or below which the weight is ``low_pressure_weight``.
        high: pressure at or above which the weight is ``high_pressure_weight``.
        low_pressure_weight: queue weight in roomy caches (default 0.25).
        high_pressure_weight: queue weight in churning caches (default 0.10).
        idle_weight: if set, the weight at pressure 0 (caches not evicting at all), rising
            linearly to ``low_pressure_weight`` at ``idle_below``; None (default): no such
            segment.
        idle_below: where the idle segment ends (default 0.1, at most ``low``).
        warmup_weight: if set, the weight while the caches warm up
            (:meth:`EvictionPressure.warming`: no eviction yet and under ``warmup_fill`` full);
            None (default): the pressure decides from the start.
        warmup_fill: the fill that ends the warm-up (default 0.5).
        warmup_cached_only: while the caches warm up, discount a queue only up to the blocks
            the request finds cached on that worker
            (:attr:`router.scheduler.SchedulerConfig.queue_discount_cached_only`; default
            False). Needs ``warmup_weight``.

    Raises:
        ValueError: ``low > high``, ``idle_below`` outside ``(0, low]``, a negative value, or
            ``warmup_cached_only`` without ``warmup_weight``.
    """

    __slots__ = ("high", "high_pressure_weight", "idle_below", "idle_weight", "low",
                 "low_pressure_weight", "warmup_cached_only", "warmup_fill", "warmup_weight")

    def __init__(self, low: float = 0.3, high: float = 0.7, low_pressure_weight: float = 0.25,
                 high_pressure_weight: float = 0.10, idle_weight: float | None = None,
                 idle_below: float = 0.1, warmup_weight: float | None = None,
                 warmup_fill: float = 0.5, warmup_cached_only: bool = False) -> None:
        if min(low, high, low_pressure_weight, high_pressure_weight) < 0:
            raise ValueError("pressure bounds and weights must be >= 0")
        if low > high:
            raise ValueError(f"low ({low}) must not exceed high ({high})")
        if idle_weight is not None and (idle_weight < 0 or not 0 < idle_below <= low):
            raise ValueError(f"idle_weight must be >= 0 and idle_below in (0, {low}]")
        self.low = low
        self.high = high
        self.low_pressure_weight = low_pressure_weight
        self.high_pressure_weight = high_pressure_weight
        if warmup_weight is not None and (warmup_weight < 0 or not 0 < warmup_fill <= 1):
            raise ValueError("warmup_weight must be >= 0 and warmup_fill in (0, 1]")
        self.idle_weight = idle_weight
        self.idle_below = idle_below
        self.warmup_weight = warmup_weight
        self.warmup_fill = warmup_fill
        if warmup_cached_only and warmup_weight is None:
            raise ValueError("warmup_cached_only needs a warmup_weight (a warm-up to apply in)")
        self.warmup_cached_only = warmup_cached_only

    def __repr__(self) -> str:
        return (f"PressureRule(low={self.low}, high={self.high}, "
                f"low_pressure_weight={self.low_pressure_weight}, "
                f"high_pressure_weight={self.high_pressure_weight}, "
                f"idle_weight={self.idle_weight}, idle_below={self.idle_below}, "
                f"warmup_weight={self.warmup_weight}, warmup_fill={self.warmup_fill}, "
                f"warmup_cached_only={self.warmup_cached_only})")


def queue_weight_for(pressure: float, rule: PressureRule | None = None, *,
                     warming: bool = False) -> float:
    """Return the queue weight for an eviction ``pressure`` (module docstring).

    ``rule.low_pressure_weight`` at ``pressure <= rule.low``, ``rule.high_pressure_weight`` at
    ``pressure >= rule.high``, linear between. Defaults: 0.25 at <= 0.3, 0.10 at >= 0.7. With
    ``rule.idle_weight`` set, pressures below ``rule.idle_below`` run linearly from it (at 0)
    to ``rule.low_pressure_weight``; ``warming`` (:meth:`EvictionPressure.warming`) with
    ``rule.warmup_weight`` set gives that weight instead.
    """
    r = rule or _DEFAULT_RULE
    if warming and r.warmup_weight is not None:
        return r.warmup_weight
    if r.idle_weight is not None and pressure < r.idle_below:
        frac = max(pressure, 0.0) / r.idle_below
        return r.idle_weight + frac * (r.low_pressure_weight - r.idle_weight)
    if pressure <= r.low:
        return r.low_pressure_weight
    if pressure >= r.high:
        return r.high_pressure_weight
    frac = (pressure - r.low) / (r.high - r.low)
    return r.low_pressure_weight + frac * (r.high_pressure_weight - r.low_pressure_weight)


def queue_terms_for(pressure: float, rule: PressureRule | None = None, *,
                    warming: bool = False) -> tuple[float, bool]:
    """Return the queue weight (:func:`queue_weight_for`) and whether its discount stops at
    the request's cached blocks (``rule.warmup_cached_only``, while ``warming``): the two
    scheduler settings the rule sets for a decision."""
    r = rule or _DEFAULT_RULE
    return (queue_weight_for(pressure, r, warming=warming),
            warming and r.warmup_cached_only)


_DEFAULT_RULE = PressureRule()

#: The router's rule under ``--queue-weight auto``: today's 0.5 while the caches warm up (no
#: eviction yet, under half full), discounting a queue only up to the request's cached blocks
#: there, then rule K, 0.25 at pressure <= 0.3 down to 0.10 at >= 0.7 (``docs/benchmarks.md``,
#: "an eviction-pressure queue weight" and "The queue discount while the caches warm up").
ROUTER_PRESSURE_RULE = PressureRule(warmup_weight=0.5, warmup_fill=0.5,
                                    warmup_cached_only=True)
#: Pending-prefill blocks per worker discounted at the queue weight under ``auto``.
AUTO_QUEUE_CAP_BLOCKS = 3000.0
