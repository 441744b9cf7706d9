"""The token bucket behind each API key's tokens per minute, on an injected clock."""

from __future__ import annotations

import math

import pytest

from router.routing.token_bucket import TokenBucket


def test_a_full_bucket_grants_a_minute_then_says_how_long_until_the_next_request_fits() -> None:
    bucket = TokenBucket.per_minute(600, now=100.0)  # 10 tokens a second, 600 held
    assert bucket.take(450, 100.0) == 0.0
    assert bucket.remaining(100.0) == 150
    # 300 asked with 150 held: 150 short at 10 a second.
    assert bucket.take(300, 100.0) == pytest.approx(15.0)
    assert bucket.remaining(100.0) == 150  # a refused take takes nothing
    # Five seconds later 200 are held: 10 seconds to go.
    assert bucket.take(300, 105.0) == pytest.approx(10.0)
    assert bucket.take(300, 115.0) == 0.0
    assert bucket.remaining(115.0) == pytest.approx(0.0)


def test_refill_stops_at_capacity() -> None:
    bucket = TokenBucket.per_minute(60, now=0.0)
    bucket.take(60, 0.0)
    assert bucket.remaining(3600.0) == 60


def test_more_than_the_capacity_never_fits() -> None:
    bucket = TokenBucket.per_minute(60, now=0.0)
    assert bucket.take(61, 0.0) == math.inf
    assert bucket.remaining(0.0) == 60


def test_a_clock_read_out_of_order_adds_nothing() -> None:
    bucket = TokenBucket.per_minute(60, now=10.0)
    bucket.take(60, 10.0)
    assert bucket.remaining(5.0) == 0.0
    assert bucket.remaining(11.0) == pytest.approx(1.0)


@pytest.mark.parametrize(("rate", "capacity"), [(0, 1), (1, 0), (-1, 1), (math.inf, 1),
                                                (1, math.nan)])
def test_a_bucket_needs_a_positive_finite_rate_and_capacity(rate: float, capacity: float
                                                             ) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, capacity, 0.0)
