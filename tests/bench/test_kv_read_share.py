"""bench.kv_read_share: against a real sim worker it names the prefix's keys as the worker
does (every read is served whole) and reports every figure."""

from __future__ import annotations

import pytest

from bench import kv_read_share

pytestmark = pytest.mark.process  # a real sim worker


def test_the_bench_reads_the_whole_prefix_and_reports_every_figure() -> None:
    figures = kv_read_share.measure("sim", rounds=1, requests=2, max_tokens=2,
                                    prefix_blocks=8, readers=1, cpu_reads=5)
    # measure() refuses a holder that does not hold every block it reads.
    assert set(figures) == {"own_s_alone", "own_s_with_reads", "slowdown", "reads_per_s",
                            "blocks_per_s", "read_mb_per_s", "cpu_ms_per_read"}
    assert figures["reads_per_s"] > 0
    assert figures["blocks_per_s"] == figures["reads_per_s"] * 8
    assert figures["read_mb_per_s"] == 0  # the sim engine sends a count, no bytes
