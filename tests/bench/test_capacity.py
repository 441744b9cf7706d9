"""bench.capacity: the bisection over loads, its verdicts and goodput, and the simulated
replay's capacity mode end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.capacity import capacity_table, goodput, meets, search_capacity, sustained_ratio

ROOT = Path(__file__).resolve().parents[2]


def _probe_with_knee(knee: float, calls: list[float]) -> Any:
    """A policy whose TTFT p99 is 1 s below ``knee`` and 10 s above it."""
    def probe(load: float) -> dict[str, Any]:
        calls.append(load)
        return {"ttft_p99_s": 1.0 if load <= knee else 10.0, "errors": 0, "load": load}

    return probe


def test_bisection_brackets_the_knee_and_keeps_the_highest_load_that_met_the_slo() -> None:
    calls: list[float] = []
    out = search_capacity(_probe_with_knee(0.63, calls), slo_s=2.0, lo=0.2, hi=1.0, steps=3)
    assert calls == [0.2, 1.0, 0.6, 0.8, 0.7]  # lo, hi, then halving [0.6, 1.0) twice more
    assert out["sustained"] == 0.6 and not out["at_least"]
    assert out["row"]["load"] == 0.6
    assert [p["meets"] for p in out["probes"]] == [True, False, True, False, False]


def test_a_range_entirely_under_or_over_the_knee_says_so_without_bisecting() -> None:
    calls: list[float] = []
    low = search_capacity(_probe_with_knee(0.1, calls), slo_s=2.0, lo=0.2, hi=1.0, steps=5)
    assert (low["sustained"], low["row"], calls) == (0.0, None, [0.2])
    calls.clear()
    high = search_capacity(_probe_with_knee(5.0, calls), slo_s=2.0, lo=0.2, hi=1.0, steps=5)
    assert (high["sustained"], high["at_least"], calls) == (1.0, True, [0.2, 1.0])


def test_a_failed_request_or_no_ttft_misses_the_slo_whatever_the_p99() -> None:
    assert meets({"ttft_p99_s": 0.5, "errors": 0}, 1.0)
    assert not meets({"ttft_p99_s": 0.5, "errors": 1}, 1.0)
    assert not meets({"ttft_p99_s": math.nan}, 1.0)
    assert not meets({"ttft_p99_s": 1.5}, 1.0)
    with pytest.raises(ValueError, match="0 < lo < hi"):
        search_capacity(lambda load: {}, slo_s=1.0, lo=1.0, hi=0.5, steps=1)


def test_goodput_counts_only_requests_under_the_slo() -> None:
    req_s, tok_s = goodput([0.1, 0.5, 3.0, 0.2], [100, 200, 400, 300], 10.0, slo_s=1.0)
    assert req_s == pytest.approx(0.3) and tok_s == pytest.approx(60.0)
    assert goodput([0.1], [5], 0.0, 1.0) == (0.0, 0.0)


def test_the_ratio_is_the_kv_policys_sustained_load_over_round_robins() -> None:
    results = {"kv": {"sustained": 0.9, "at_least": False, "row": None, "probes": []},
               "round_robin": {"sustained": 0.3, "at_least": False, "row": None, "probes": []}}
    assert sustained_ratio(results) == pytest.approx(3.0)
    assert sustained_ratio({"kvroute": results["kv"], "round_robin": results["round_robin"]}
                           ) == pytest.approx(3.0)
    assert sustained_ratio({"kv": results["kv"]}) is None
    zero = {"kv": results["kv"], "round_robin": {**results["round_robin"], "sustained": 0.0}}
    assert sustained_ratio(zero) is None
    assert "kv sustains 3.00x round-robin's load" in capacity_table(results, 2.0, "load")


@pytest.mark.process
def test_replay_capacity_mode_searches_each_policy_and_writes_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "cap.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.replay", "--generator", "long_context", "--requests", "40",
         "--workers", "2", "--policies", "kvroute,round_robin", "--slo", "2",
         "--capacity-range", "0.5,4", "--capacity-steps", "1", "--no-progress",
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "capacity at TTFT p99 <= 2 s" in run.stdout
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {"kvroute", "round_robin"}
    for result in doc["policies"].values():
        loads = [p["load"] for p in result["probes"]]
        assert loads[0] == 0.5 and len(loads) <= 3  # lo, then hi and one bisection if needed
        if result["sustained"]:
            assert result["row"]["ttft_p99_s"] <= 2.0
            assert result["row"]["goodput_req_s"] > 0


@pytest.mark.process
def test_replay_capacity_mode_refuses_a_bad_range_in_one_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.replay", "--generator", "long_context", "--requests", "10",
         "--slo", "2", "--capacity-range", "4,1", "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "0 < lo < hi" in run.stderr
