"""A run's report row: the means and percentiles come from the requests' own times."""

from __future__ import annotations

import math

from bench.figures import mean, percentile
from bench.policies import POLICIES
from bench.report import METRIC_KEYS, summarize, table
from bench.sim import SimConfig, simulate
from bench.workloads import GeneratorConfig, generate


def test_mean_and_percentile_of_known_values() -> None:
    assert mean([1.0, 2.0, 6.0]) == 3.0
    assert math.isnan(mean([]))
    assert percentile([1.0, 2.0, 6.0], 50) == 2.0
    assert percentile([0.0, 10.0], 25) == 2.5


def test_row_means_are_the_records_means_and_the_table_shows_them() -> None:
    reqs = generate("multi_turn", GeneratorConfig(
        requests=30, rate=4.0, system_prompts=2, system_tokens=(512, 1024),
        user_tokens=(64, 256), output_tokens=(4, 24), turn_gap_s=0.5), seed=2)
    res = simulate(reqs, POLICIES["round_robin"](), SimConfig(workers=2, capacity_tokens=40_000),
                   seed=1)
    row = summarize(res, None)
    ttft = [r.ttft_s for r in res.records]
    e2e = [r.e2e_s for r in res.records]
    assert set(METRIC_KEYS) <= set(row)
    assert row["ttft_mean_s"] == math.fsum(ttft) / len(ttft)
    assert row["e2e_mean_s"] == math.fsum(e2e) / len(e2e)
    assert min(ttft) < row["ttft_mean_s"] < max(ttft)
    assert row["ttft_mean_s"] < row["e2e_mean_s"]
    text = table([row])
    assert "TTFT mean" in text.splitlines()[0]
    assert f"{row['ttft_mean_s']:.3f}" in text.splitlines()[1]
