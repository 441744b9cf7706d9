"""The queue discount while caches warm up: a queue is discounted only as far as the request
finds its blocks cached behind it (``SchedulerConfig.queue_discount_cached_only``), with
``continue_rate`` of the rest kept where sessions continue."""

from __future__ import annotations

import random

import pytest

from router.scheduler import Candidate, SchedulerConfig, choose, cost_of

WHOLE = SchedulerConfig(overlap_weight=1.0, affinity_weight=1.0, queue_weight=0.5)
CACHED_ONLY = SchedulerConfig(overlap_weight=1.0, affinity_weight=1.0, queue_weight=0.5,
                              queue_discount_cached_only=True)


@pytest.mark.parametrize(("matched", "rate", "queued"), [
    (0, 0.0, 100.0),     # nothing cached there: the whole queue counts
    (40, 0.0, 80.0),     # 40 discounted (20) + 60 at full weight
    (200, 0.0, 50.0),    # more cached than queued: the whole queue discounted, as before
    (40, 1.0, 50.0),     # sessions always continue: the whole discount kept
    (40, 0.5, 65.0),     # half of the uncached 60 discounted: 0.5 * 70 + 30
])
def test_the_discount_stops_at_the_cached_blocks(matched: int, rate: float,
                                                  queued: float) -> None:
    c = Candidate(0, matched, matched, pending_prefill_blocks=100)
    cost = cost_of(c, 210, CACHED_ONLY, continue_rate=rate)
    assert cost.prefill_blocks == pytest.approx((210 - matched) + queued)
    assert cost_of(c, 210, WHOLE, continue_rate=rate).prefill_blocks == pytest.approx(
        (210 - matched) + 50.0)


def test_a_cold_request_no_longer_lands_behind_the_longer_queue() -> None:
    # A new system prompt nobody holds: worker 0 has 100 blocks of prefill queued, worker 1 a
    # heavy decode load (2,500 blocks at 1/32 of a prefill block each). Discounting the whole
    # queue sends it behind worker 0's queue (32 * (10 + 50) = 1,920 < 32 * 10 + 2,500); whole,
    # the queue costs 32 * 110 = 3,520 and worker 1 wins.
    cands = [Candidate(0, pending_prefill_blocks=100), Candidate(1, decode_blocks=2500)]
    whole = SchedulerConfig(queue_weight=0.5)
    cached_only = SchedulerConfig(queue_weight=0.5, queue_discount_cached_only=True)
    assert choose(10, cands, whole, random.Random(0), continue_rate=0.0).worker == 0
    assert choose(10, cands, cached_only, random.Random(0), continue_rate=0.0).worker == 1


def test_a_request_cached_behind_the_queue_still_waits_for_it() -> None:
    # Worker 0 holds 200 of the 210 blocks behind 150 queued: waiting saves more than it
    # costs, with or without the limit (10 + 75 against 210 to recompute on idle worker 1).
    cands = [Candidate(0, 200, 200, pending_prefill_blocks=150), Candidate(1)]
    for config in (WHOLE, CACHED_ONLY):
        assert choose(210, cands, config, random.Random(0), continue_rate=0.0).worker == 0


def test_the_cap_still_applies_first() -> None:
    # Past queue_cap_blocks the queue counts whole either way.
    config = SchedulerConfig(overlap_weight=1.0, affinity_weight=1.0, queue_weight=0.5,
                             queue_cap_blocks=100,
                             queue_discount_cached_only=True)
    c = Candidate(0, 300, 300, pending_prefill_blocks=400)
    assert cost_of(c, 300, config, continue_rate=0.0).prefill_blocks == pytest.approx(350)
