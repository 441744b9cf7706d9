"""Eviction pressure: how fast the cluster's device caches are turning over.

The signal, from the workers' normalised KV events (:mod:`indexer.events`) alone::

    pressure(now) = device blocks removed, all workers, in the last ``window_s`` seconds
                    / sum over workers of the most device blocks each has held at once

The denominator is each worker's peak resident count (stored minus removed, as a consumer of
its events sees it): once a cache has filled that is its capacity, learned without asking the
engine. So the pressure is the share of the cluster's cache evicted in the window. It
separates the benchmark's workloads cleanly (``docs/benchmarks.md``): median about 0.56-0.70
on the synthetic trace at 0.5M tokens per worker, about 0.01 at 2M, 0 on the generators. The
routing core shows it (``/metrics``); the rule in seconds does not price it.
:meth:`EvictionPressure.warming` says whether the caches are still warming up (no device
eviction yet and under :data:`WARMUP_FILL` of the workers' device blocks resident).

Pure: the caller passes ``now`` (seconds, any monotonic origin) with every call. No I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from indexer.events import Cleared, Event, Removed, Stored, Tier, tier_of

__all__ = ["EvictionPressure"]

#: The share of the workers' device blocks resident that ends the warm-up.
WARMUP_FILL = 0.5



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
        # Their sums, kept as they change: a decision reads them, and a fleet is large.
        self._resident_total = 0
        self._peak_total = 0
        self._removals: deque[tuple[float, int]] = deque()  # (time, blocks), oldest first
        self._removed_in_window = 0
        #: The warm-up has ended (:meth:`warming`): a device block was evicted, or the caches
        #: were found full enough. Read it; it is set here.
        self.warmed = False

    def observe(self, worker: int, events: Iterable[Event], now: float) -> int:
        """Account one batch of ``worker``'s events received at ``now``, in order. Returns
        the device blocks the batch stored."""
        stored = 0
        for e in events:
            if isinstance(e, Stored):
                if tier_of(e.medium) == Tier.DEVICE:
                    stored += len(e.block_hashes)
                    self._store(worker, len(e.block_hashes))
            elif isinstance(e, Removed):
                if tier_of(e.medium) == Tier.DEVICE:
                    self._remove(worker, len(e.block_hashes), now)
            elif isinstance(e, Cleared):
                # A restart or reset, not eviction: nothing resident, no removals counted.
                self._resident_total -= self._resident.get(worker, 0)
                self._resident[worker] = 0
                if self.warmed and not self._resident_total:
                    self.warmed = False  # every cache is empty again: a cold cluster
        self._prune(now)
        return stored

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
        self._resident_total += blocks
        peak = self._peak.get(worker, 0)
        if resident > peak or worker not in self._peak:
            self._peak[worker] = resident
            self._peak_total += resident - peak

    def _remove(self, worker: int, blocks: int, now: float) -> None:
        resident = self._resident.get(worker, 0)
        left = max(resident - blocks, 0)
        self._resident[worker] = left
        self._resident_total -= resident - left
        self._peak.setdefault(worker, 0)
        if blocks:
            self._removals.append((now, blocks))
            self._removed_in_window += blocks
            self.warmed = True

    def forget(self, worker: int) -> None:
        """Drop a worker's resident and peak counts (it left the cluster). Its removals already
        in the window stay until they age out."""
        self._resident_total -= self._resident.pop(worker, 0)
        self._peak_total -= self._peak.pop(worker, 0)

    def warming(self, capacity_blocks: float, fill: float = WARMUP_FILL) -> bool:
        """True until the first device eviction and while the resident blocks are under
        ``fill`` x ``capacity_blocks`` (the workers' device blocks; 0 = unknown, then only an
        eviction ends it). Once over, it stays over: a cache that filled once is in the
        regime the pressure rule is for; one worker's restart does not change that. Only a
        reset that leaves every worker's cache empty (each has sent ``Cleared`` and stored
        nothing since) starts the warm-up again, as on a fresh cluster."""
        if not self.warmed and capacity_blocks > 0:
            self.warmed = self._resident_total >= fill * capacity_blocks
        return not self.warmed

    def pressure(self, now: float) -> float:
        """Blocks removed in ``(now - window_s, now]`` over the sum of peak resident blocks;
        0.0 before any worker has held a block."""
        q = self._removals
        if q and q[0][0] <= now - self.window_s:
            self._prune(now)
        capacity = self._peak_total
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
