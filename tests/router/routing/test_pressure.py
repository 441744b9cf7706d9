"""Eviction pressure (window, peaks, tiers, clears), the pressure -> queue weight rule, and the
scheduler's queue cap."""

from __future__ import annotations

import random

import pytest

from indexer.events import Cleared, Removed, Stored
from router.routing.pressure import EvictionPressure


def stored(n: int, medium: str | None = None) -> Stored:
    return Stored(list(range(n)), None, [0] * (n * 4), 4, medium)


def removed(n: int, medium: str | None = None) -> Removed:
    return Removed(list(range(n)), medium)


def test_pressure_is_removals_in_the_window_over_the_sum_of_peaks() -> None:
    p = EvictionPressure(window_s=10.0)
    assert p.pressure(0.0) == 0.0  # nothing held yet: no division by zero
    p.observe(0, [stored(100)], 0.0)
    p.observe(1, [stored(300)], 0.0)
    assert p.pressure(0.0) == 0.0
    p.observe(0, [removed(40), stored(40)], 1.0)  # full: evicts to store
    p.observe(1, [removed(60)], 2.0)
    assert p.peak(0) == 100 and p.resident(0) == 100
    assert p.peak(1) == 300 and p.resident(1) == 240
    assert p.pressure(2.0) == pytest.approx(100 / 400)
    # The removal at t=1 leaves the window at t=11 (window is (now - 10, now]).
    assert p.pressure(10.999) == pytest.approx(100 / 400)
    assert p.pressure(11.0) == pytest.approx(60 / 400)
    assert p.pressure(12.0) == 0.0


def test_peak_is_kept_when_the_cache_drains_so_pressure_is_over_capacity() -> None:
    p = EvictionPressure(window_s=5.0)
    p.observe(0, [stored(200)], 0.0)
    p.observe(0, [removed(150)], 1.0)
    assert p.resident(0) == 50 and p.peak(0) == 200
    assert p.pressure(1.0) == pytest.approx(150 / 200)


def test_events_apply_in_order_within_a_batch() -> None:
    # Remove-then-store never exceeds the capacity; store-then-remove does, briefly.
    a, b = EvictionPressure(), EvictionPressure()
    a.observe(0, [stored(10)], 0.0)
    b.observe(0, [stored(10)], 0.0)
    a.observe(0, [removed(5), stored(5)], 1.0)
    b.observe(0, [stored(5), removed(5)], 1.0)
    assert a.peak(0) == 10 and b.peak(0) == 15
    assert a.resident(0) == b.resident(0) == 10


def test_host_tier_events_do_not_count() -> None:
    p = EvictionPressure()
    p.observe(0, [stored(100), stored(50, "CPU"), removed(30, "cpu_tier")], 0.0)
    assert p.peak(0) == 100 and p.pressure(0.0) == 0.0
    p.observe(0, [removed(30, "GPU")], 1.0)
    assert p.pressure(1.0) == pytest.approx(0.3)


def test_clear_is_not_eviction_and_keeps_the_peak() -> None:
    p = EvictionPressure()
    p.observe(0, [stored(100)], 0.0)
    p.observe(0, [Cleared()], 1.0)
    assert p.resident(0) == 0 and p.peak(0) == 100 and p.pressure(1.0) == 0.0
    # A removal of blocks from before the router listened does not go negative.
    p.observe(0, [removed(10)], 2.0)
    assert p.resident(0) == 0 and p.pressure(2.0) == pytest.approx(0.1)


def test_record_counts_match_observed_events_and_forget_drops_the_worker() -> None:
    p, q = EvictionPressure(), EvictionPressure()
    p.observe(0, [stored(80)], 0.0)
    p.observe(0, [removed(20), stored(20)], 1.0)
    q.record(0, stored=80, removed=0, now=0.0)
    q.record(0, stored=20, removed=20, now=1.0)
    assert (p.peak(0), p.resident(0), p.pressure(1.0)) == (q.peak(0), q.resident(0),
                                                          q.pressure(1.0))
    q.record(1, stored=80, removed=0, now=1.0)
    assert q.pressure(1.0) == pytest.approx(20 / 160)
    q.forget(1)
    assert q.peak(1) == 0 and q.pressure(1.0) == pytest.approx(20 / 80)
    with pytest.raises(ValueError):
        q.record(0, stored=-1, removed=0, now=2.0)
    with pytest.raises(ValueError):
        EvictionPressure(window_s=0.0)


def test_sums_kept_as_counts_change_equal_the_sums_recomputed() -> None:
    """The pressure's denominator and the warm-up's fill are running sums; after any mix of
    stores, removals, clears and departures they equal the per-worker counts summed."""
    rng = random.Random(5)
    p, q = EvictionPressure(window_s=5.0), EvictionPressure()  # q: no removals
    removals: list[tuple[float, int]] = []
    for step in range(3000):
        worker, now = rng.randrange(12), step * 0.01
        action = rng.random()
        if action < 0.85:
            stored, gone = rng.randrange(50), rng.randrange(80) if action > 0.45 else 0
            p.record(worker, stored, gone, now)
            q.record(worker, stored, 0, now)
            removals.append((now, gone))
        elif action < 0.95:
            p.observe(worker, [Cleared()], now)
            q.observe(worker, [Cleared()], now)
        else:
            p.forget(worker)
            q.forget(worker)
        peaks = sum(p.peak(w) for w in range(12))
        in_window = sum(n for t, n in removals if t > now - 5.0)
        assert p.pressure(now) == pytest.approx(in_window / peaks if peaks else 0.0)
    resident = sum(q.resident(w) for w in range(12))
    assert resident > 0
    assert q.warming(2 * resident + 2)  # under half of that capacity: still warming
    assert not q.warming(2 * resident)  # exactly half: warm


def test_warm_up_ends_at_the_fill_or_the_first_eviction() -> None:
    p = EvictionPressure()
    p.observe(0, [stored(40)], 0.0)
    p.observe(1, [stored(49)], 0.0)
    assert p.warming(capacity_blocks=200, fill=0.5)  # 89 of 200 resident: under half
    p.observe(1, [stored(11)], 1.0)
    assert not p.warming(capacity_blocks=200, fill=0.5)  # 100: half full, and it stays over
    q = EvictionPressure()
    q.observe(0, [stored(10), removed(1)], 0.0)
    assert not q.warming(capacity_blocks=200, fill=0.5)  # an eviction ends it at any fill
    r = EvictionPressure()
    r.observe(0, [stored(150)], 0.0)
    assert r.warming(capacity_blocks=0, fill=0.5)  # capacity unknown: only an eviction ends it


def test_one_restart_keeps_the_cluster_warm_and_a_full_reset_warms_it_up_again() -> None:
    p = EvictionPressure()
    p.observe(0, [stored(100), removed(10)], 0.0)
    p.observe(1, [stored(100)], 0.0)
    assert not p.warming(capacity_blocks=400, fill=0.5)
    p.observe(0, [Cleared()], 1.0)  # worker 0 restarts; worker 1 still holds its blocks
    assert not p.warming(capacity_blocks=400, fill=0.5)
    p.observe(1, [Cleared()], 2.0)  # now every cache is empty
    assert p.warming(capacity_blocks=400, fill=0.5)
    p.observe(0, [stored(150)], 3.0)
    p.observe(1, [stored(60)], 3.0)
    assert not p.warming(capacity_blocks=400, fill=0.5)  # half full again
