"""Live mode replays a trace through a real router and workers, measured from the client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.replay import main

NUM_BLOCKS = 4096  # the e2e workers' default cache: 4,096 blocks of 32 tokens


def test_live_replay_reports_hits_bounds_and_plots(cluster: Any, tmp_path: Path) -> None:
    router, _ = cluster(workers=2)
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1100 + 8 * i, "output_length": 4,
             "hash_ids": [0, 1, 100 + i]} for i in range(12)]  # 1,024 shared tokens each
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, plots = tmp_path / "live.json", tmp_path / "plots"
    status = main(["--trace", str(trace), "--live", router.url, "--workers", "2",
                   "--capacity-tokens", str(NUM_BLOCKS * 32), "--json", str(out),
                   "--plot-dir", str(plots), "--no-progress"])
    assert status == 0
    doc = json.loads(out.read_text())
    (row,) = doc["runs"][0]["rows"]
    assert row["requests"] == 12 and row["errors"] == 0
    assert 0 < row["ttft_p50_s"] <= row["e2e_p50_s"] < 30
    # the workers report cached prompt tokens: the router keeps the shared 1,024 on one
    # worker, so 11 of 12 requests find them (round-robin's two cold starts would give 0.91)
    assert 0 < row["hit_rate"] <= doc["bounds"]["unlimited"]
    assert row["hit_vs_pooled"] == row["hit_rate"] / doc["bounds"]["pooled_lru"] > 0.95
    # The hit split by the TTFT paid for it: at each threshold the two parts make the whole.
    assert [s["over_s"] for s in row["hit_by_wait"]] == [1.0, 2.4, 5.0]
    for s in row["hit_by_wait"]:
        assert s["hit"] == row["hit_rate"]
        assert s["slow_hit"] + s["hit_without"] == pytest.approx(s["hit"])
    for name in ("ttft_cdf.png", "hit_rate.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [Path(p).name for p in doc["runs"][0]["plots"]] == ["ttft_cdf.png", "hit_rate.png"]
