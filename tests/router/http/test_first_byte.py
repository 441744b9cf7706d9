"""The first-byte deadline: the floor, the prior, a learned rate that rises at once and falls
slowly, and the ceiling."""

from __future__ import annotations

import pytest

from router.http.first_byte import PRIOR_S_PER_BLOCK, FirstByteClock


def test_before_any_stream_the_prior_rate_sets_the_deadline() -> None:
    clock = FirstByteClock(floor=2.0, factor=4.0, ceiling=300.0)
    assert clock.deadline(0, blocks_ahead=1) == 2.0  # 4 x 0.05 s is under the floor
    assert clock.deadline(0, 100) == pytest.approx(4 * PRIOR_S_PER_BLOCK * 100)
    assert clock.deadline(0, 1e9) == 300.0


def test_a_slower_sample_replaces_the_rate_and_a_faster_one_moves_it_a_tenth() -> None:
    clock = FirstByteClock(floor=0.1, factor=2.0, ceiling=300.0)
    clock.observed(0, blocks_ahead=100, seconds=1.0)  # 10 ms a block
    assert clock.rate(0) == pytest.approx(0.01)
    clock.observed(0, blocks_ahead=100, seconds=0.1)  # 1 ms a block: a tenth of the way
    assert clock.rate(0) == pytest.approx(0.01 - 0.1 * 0.009)
    clock.observed(0, blocks_ahead=10, seconds=1.0)  # 100 ms a block: at once
    assert clock.rate(0) == pytest.approx(0.1)
    assert clock.deadline(0, 50) == pytest.approx(2.0 * 0.1 * 50)
    assert clock.rate(1) is None  # per worker
    clock.forget(0)
    assert clock.rate(0) is None


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        FirstByteClock(floor=5.0, factor=4.0, ceiling=2.0)
    with pytest.raises(ValueError):
        FirstByteClock(floor=1.0, factor=0.5, ceiling=2.0)
