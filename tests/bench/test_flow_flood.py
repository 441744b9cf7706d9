"""bench.flow_flood's summary: how each request of the flood ended, and the high-priority
TTFT alone and under it."""

from __future__ import annotations

import pytest

from bench.flow_flood import Outcome, summarize


def test_the_summary_counts_every_ending_and_compares_the_urgent_ttft() -> None:
    alone = [Outcome(0, "served", 200, ttft_s=0.010), Outcome(0, "served", 200, ttft_s=0.020)]
    flood = [Outcome(0, "served", 200, ttft_s=0.030), Outcome(0, "served", 200, ttft_s=0.040),
             Outcome(10, "served", 200, ttft_s=5.0, answered_s=5.0),
             Outcome(10, "refused", 429, "3", answered_s=0.01),
             Outcome(10, "refused", 429, None, answered_s=0.02),
             Outcome(10, "refused", 503, answered_s=0.5),
             Outcome(10, "timeout"), Outcome(10, "lost")]
    row = summarize(alone, flood)
    assert row["alone_p50_ms"] == pytest.approx(20.0)  # the upper median of two
    assert row["flood_p50_ms"] == pytest.approx(40.0)
    assert row["ratio_p50"] == pytest.approx(2.0)
    assert (row["high_served"], row["high"], row["requests"]) == (2, 2, 8)
    assert row["low_ttft_p50_s"] == 5.0
    assert row["refused_answer_max_s"] == 0.5
    assert {k: row[k] for k in ("served", "refused_429", "refused_429_no_retry_after",
                                "refused_503", "timeout", "lost")} == {
        "served": 3, "refused_429": 1, "refused_429_no_retry_after": 1, "refused_503": 1,
        "timeout": 1, "lost": 1}
