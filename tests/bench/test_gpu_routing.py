"""bench.gpu_routing: the trace window it replays, and one real run on the CPU (tiny model,
two torch worker processes behind the real router, each router policy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_routing import summarize_repeats, window
from bench.workloads import trace_block_tokens
from tests.support.lazy import require

pytestmark = pytest.mark.process  # starts child processes

ROOT = Path(__file__).resolve().parents[2]


def _trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    path.write_text("".join(
        json.dumps({"timestamp": t, "input_length": n, "output_length": m, "hash_ids": ids}) + "\n"
        for t, n, m, ids in rows))
    return path


def test_window_cuts_retimes_drops_long_prompts_and_scales_outputs(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", [
        (0, 100, 10, [1]), (1000, 600, 8, [1, 2]), (1500, 2000, 40, [1, 2, 3, 4]),
        (2500, 300, 3, [5]), (4000, 50, 1, [6]),
    ])
    requests, skipped = window(trace, 1, 3, max_len=1024, output_scale=0.5)
    assert skipped == 1  # the 2,000-token request
    assert [r.input_length for r in requests] == [600, 300]
    assert [r.arrival_s for r in requests] == [0.0, 1.5]  # from the first kept request
    assert [r.output_length for r in requests] == [4, 2]  # 3 * 0.5 rounds to 2, never 0
    assert requests[0].token_ids() == (trace_block_tokens(1) + trace_block_tokens(2))[:600]


def test_a_bad_trace_exits_2_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    run = subprocess.run([sys.executable, "-m", "bench.gpu_routing", "--trace", str(bad)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "not a Mooncake trace line" in run.stderr


def test_repeats_summarize_to_medians_and_a_p50_range_per_load_and_policy() -> None:
    def row(load: float, policy: str, p50: float, hit: float) -> dict[str, float | str]:
        return {"load": load, "policy": policy, "ttft_p50_s": p50, "ttft_mean_s": 2 * p50,
                "ttft_p99_s": 10 * p50, "hit_rate": hit}

    runs = [row(0.3, "round_robin", 4.0, 0.27), row(0.3, "kv", 0.30, 0.67),
            row(0.3, "round_robin", 3.0, 0.28), row(0.3, "kv", 0.20, 0.68),
            row(0.3, "kv", 0.25, 0.66), row(0.45, "kv", 0.9, 0.6)]
    summary = {(m["load"], m["policy"]): m for m in summarize_repeats(runs)}
    assert [(m["load"], m["policy"]) for m in summarize_repeats(runs)] == [
        (0.3, "round_robin"), (0.3, "kv"), (0.45, "kv")]  # first-run order
    kv = summary[(0.3, "kv")]
    assert kv["runs"] == 3 and kv["ttft_p50_s"] == 0.25 and kv["hit_rate"] == 0.67
    assert (kv["ttft_p50_min_s"], kv["ttft_p50_max_s"]) == (0.20, 0.30)
    assert kv["ttft_mean_s"] == 0.5 and kv["ttft_p99_s"] == 2.5
    rr = summary[(0.3, "round_robin")]
    assert rr["runs"] == 2 and rr["ttft_p50_s"] == 3.5  # the median of two is their mean
    assert summary[(0.45, "kv")]["runs"] == 1


def test_zero_repeats_exit_2_before_starting_anything(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", [(0, 100, 1, [1])])
    run = subprocess.run([sys.executable, "-m", "bench.gpu_routing", "--trace", str(trace),
                          "--repeats", "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2
    assert "--repeats must be at least 1, got 0" in run.stderr


def test_round_robin_and_kv_clusters_of_torch_workers_replay_the_trace(tmp_path: Path) -> None:
    require("torch")
    # Twelve requests sharing one 512-token prefix (hash id 0), each with 200 tokens of its
    # own. None holds another's last block, so none continues a session: what kv does with
    # a prefix everyone shares is all this run measures.
    rows = [(i * 50, 712, 2, [0, 1 + i]) for i in range(12)]
    trace = _trace(tmp_path / "t.jsonl", rows)
    out = tmp_path / "out.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu_routing", "--workers", "2", "--model", "tiny",
         "--device", "cpu", "--kv-memory-gb", "0.02", "--trace", str(trace), "--count", "12",
         "--loads", "0.5", "--cold-rate", "20000", "--warmup-tokens", "64",
         "--log-dir", str(tmp_path / "logs"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    runs = {r["policy"]: r for r in result["runs"]}
    assert set(runs) == {"round_robin", "kv"}
    assert all(r["errors"] == 0 and r["requests"] == 12 for r in runs.values())
    assert runs["round_robin"]["worker_requests"] == [6.0, 6.0]
    assert sum(runs["kv"]["worker_requests"]) == 12
    # kv follows the prefix's holder until its queue would take longer than recomputing the
    # prefix on the other worker (then both hold it); round-robin alternates from the start.
    assert max(runs["kv"]["worker_requests"]) > 6
    assert runs["kv"]["hit_rate"] >= runs["round_robin"]["hit_rate"]
    assert "round-robin TTFT p50 / kv TTFT p50" in run.stdout
    assert [(m["policy"], m["runs"]) for m in result["summary"]] == [("round_robin", 1), ("kv", 1)]
    assert all(r["repeat"] == 0 for r in result["runs"])


def test_capacity_mode_searches_each_policy_on_one_cluster_and_prints_the_ratio(
    tmp_path: Path,
) -> None:
    require("torch")
    trace = _trace(tmp_path / "t.jsonl", [(i * 50, 712, 2, [0, 1 + i]) for i in range(12)])
    out = tmp_path / "out.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu_routing", "--workers", "2", "--model", "tiny",
         "--device", "cpu", "--kv-memory-gb", "0.02", "--trace", str(trace), "--count", "12",
         "--cold-rate", "20000", "--warmup-tokens", "64", "--slo", "30",
         "--capacity-range", "0.2,1", "--capacity-steps", "0", "--mps", "off",
         "--log-dir", str(tmp_path / "logs"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["mps"] == "off"
    capacity = result["capacity"]["policies"]
    assert set(capacity) == {"round_robin", "kv"}
    for policy in capacity.values():
        # a 30 s SLO on an idle CPU fleet: both ends of the range met, no bisection
        assert [p["load"] for p in policy["probes"]] == [0.2, 1.0]
        assert policy["sustained"] == 1.0 and policy["at_least"]
        assert policy["row"]["errors"] == 0 and policy["row"]["goodput_req_s"] > 0
    assert result["capacity"]["ratio"] == pytest.approx(1.0)
    assert "kv sustains 1.00x round-robin's load at this SLO" in run.stdout


def test_a_bad_capacity_range_exits_2_before_starting_anything(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", [(0, 100, 1, [1])])
    run = subprocess.run([sys.executable, "-m", "bench.gpu_routing", "--trace", str(trace),
                          "--slo", "2", "--capacity-range", "1,0.5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--capacity-range LO,HI with 0 < LO < HI" in run.stderr
