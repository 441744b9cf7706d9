"""The prefill demand meter: decaying rates and the capacity they are set against, on an
injected clock."""

from __future__ import annotations

import math

import pytest

from router.routing.demand import DecayingRate, PrefillDemand
from router.routing.rates import Rates


def test_a_steady_stream_reads_as_its_rate_from_the_first_seconds() -> None:
    rate = DecayingRate(60.0, now=0.0)
    for second in range(1, 11):
        rate.add(500, float(second))
    # What arrived, decayed, over what a steady unit rate sums to in 10 s: 500 and a little
    # more (each second's 500 is counted as it ends).
    summed = sum(500 * math.exp(-(10 - s) / 60) for s in range(1, 11))
    assert rate.rate(10.0) == pytest.approx(summed / (60 * -math.expm1(-10 / 60)))
    assert 500 < rate.rate(10.0) < 510
    for second in range(11, 601):
        rate.add(500, float(second))
    assert rate.rate(600.0) == pytest.approx(500, rel=0.01)


def test_the_rate_decays_once_the_stream_stops() -> None:
    rate = DecayingRate(60.0, now=0.0)
    for second in range(1, 601):
        rate.add(100, float(second))
    before = rate.rate(600.0)
    assert rate.rate(660.0) == pytest.approx(before * math.exp(-1), rel=1e-3)
    assert rate.rate(600.0 + 60 * 20) < 1e-6


def test_nothing_counted_reads_zero_and_a_bad_window_is_refused() -> None:
    assert DecayingRate(1.0, 5.0).rate(5.0) == 0.0
    assert DecayingRate(1.0, 5.0).rate(100.0) == 0.0
    for window in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            DecayingRate(window, 0.0)


def test_the_ratio_is_uncached_tokens_over_what_the_workers_prefill_at_that_context() -> None:
    demand = PrefillDemand(10.0, now=0.0)
    # Two requests a second for 200 s: 1,000 uncached tokens after 3,000 cached, and a
    # whole hit (nothing to prefill, not counted).
    for second in range(1, 201):
        demand.routed(1000, 3000, float(second))
        demand.routed(0, 4000, float(second))
    # Read as a second's requests arrive: 1/10 of a window's worth more than their mean.
    assert demand.tokens_per_second(200.0) == pytest.approx(1000 / 10 / -math.expm1(-1 / 10))
    assert demand.mean_context(200.0) == pytest.approx(3500)
    # 1 µs a token, 1 ns a token of context: 4.5 µs a token at 3,500, 222,222 tokens a
    # second each.
    worker = Rates(prefill_s=1e-6, context_s=1e-9)
    assert demand.capacity([worker, worker], 200.0) == pytest.approx(2 / 4.5e-6)
    assert demand.ratio([worker, worker], 200.0) == pytest.approx(
        demand.tokens_per_second(200.0) * 4.5e-6 / 2)
    # A slower worker (its learned factor 2) adds half as much.
    slow = Rates(prefill_s=2e-6, context_s=2e-9)
    assert demand.capacity([worker, slow], 200.0) == pytest.approx(1.5 / 4.5e-6)


def test_without_workers_or_traffic_the_ratio_is_zero() -> None:
    demand = PrefillDemand(10.0, now=0.0)
    assert demand.ratio([Rates(prefill_s=1e-6)], 5.0) == 0.0
    demand.routed(100, 0, 1.0)
    assert demand.ratio([], 5.0) == 0.0
    assert demand.ratio([Rates(prefill_s=0.0)], 5.0) == 0.0
    # No traffic seen: the capacity is the plain prefill rate.
    assert PrefillDemand(10.0, 0.0).capacity([Rates(prefill_s=1e-6, context_s=1.0)], 1.0) \
        == pytest.approx(1e6)
