"""bench.gpu.mix: kernel classes, configs, the per-kind summary of iterations, and one run of
one tiny engine process on the CPU through the real engine loop."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.gpu.flops import attention_flops, linear_flops
from bench.gpu.mix import (
    IterationRow,
    kernel_class,
    parse_configs,
    parse_workload,
    plan_flops,
    process_workload,
    summarize_rows,
)
from tests.support.lazy import require
from workers.torch.shapes import CONFIGS

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_are_classed_by_name() -> None:
    assert kernel_class("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64") == (
        "attention")
    assert kernel_class("paged_attention_kernel") == "attention"
    assert kernel_class("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT") == "matmul"
    assert kernel_class("void at::native::index_elementwise_kernel<128, 4, at::native::index_copy"
                        ) == "copy/index"
    assert kernel_class("Memcpy HtoD (Pageable -> Device)") == "copy/index"
    assert kernel_class("void at::native::vectorized_layer_norm_kernel<c10::BFloat16") == (
        "elementwise")
    assert kernel_class("something_else") == "other"


def test_configs_parse_and_bad_ones_say_what_was_expected() -> None:
    assert parse_configs("1:off, 4:on,4:auto") == [(1, "off"), (4, "on"), (4, "auto")]
    for bad in ("4", "0:off", "x:on", "4:maybe"):
        with pytest.raises(ValueError, match="is not WORKERS:MODE"):
            parse_configs(bad)


def test_workloads_parse_and_a_bad_one_says_what_was_expected() -> None:
    assert parse_workload("long_context") == ("long_context", (0, 0))
    assert parse_workload("trace:100:30") == ("trace", (100, 30))
    assert parse_workload("trace") == ("trace", (0, 400))
    for bad in ("trace:1", "trace:a:3", "trace:0:0", "sessions"):
        with pytest.raises(ValueError, match="not long_context or trace:FIRST:COUNT"):
            parse_workload(bad)


def test_the_traces_window_is_dealt_to_the_processes_at_their_share_of_the_load() -> None:
    args = argparse.Namespace(workload="trace", trace_window=(10, 40), trace=None,
                              max_model_len=1 << 20, load=0.5, cold_rate=100_000.0)
    shares = [process_workload(args, rank, 4) for rank in range(4)]
    ids = [r.request_id for share in shares for r in share]
    assert sorted(ids, key=lambda x: int(x[1:])) == [f"t{i}" for i in range(10, 50)]
    for share in shares:
        assert share[0].arrival_s == 0.0
        rate = sum(r.input_length for r in share) / share[-1].arrival_s
        assert rate == pytest.approx(0.5 * 100_000 / 4)


def test_a_passes_arithmetic_counts_each_chunk_over_its_context_and_each_decode() -> None:
    c = CONFIGS["llama-1b"]
    plan = SimpleNamespace(prefill=[SimpleNamespace(num_new_tokens=2048, start=8192)],
                           decode=[SimpleNamespace(context_len=100)] * 3)
    f = plan_flops(c, plan)
    assert f["matmul"] == linear_flops(c, 2051)
    assert f["attention"] == pytest.approx(attention_flops(c, 2048 + 8192) - attention_flops(
        c, 8192) + 3 * (attention_flops(c, 100) - attention_flops(c, 99)))


def test_iterations_summarize_by_kind_and_path_with_their_share_of_the_time() -> None:
    rows = [IterationRow("decode", "graph", 8, 8, 0.004, 0.001, 0.003, 0.004),
            IterationRow("decode", "graph", 8, 8, 0.006, 0.001, 0.005, 0.006),
            IterationRow("mixed", "eager", 8200, 8, 0.090, 0.060, 0.030, 0.090)]
    out = summarize_rows(rows)
    assert set(out) == {"all", "decode", "decode/graph", "mixed", "mixed/eager"}
    assert out["decode"]["count"] == 2 and out["decode"]["wall_ms"] == pytest.approx(5.0)
    assert out["decode"]["wait_ms"] == pytest.approx(4.0)
    assert out["mixed"]["time_share"] == pytest.approx(0.9)
    assert out["all"]["tokens"] == pytest.approx(8216 / 3)


@pytest.mark.process
def test_one_cpu_process_runs_the_decode_step_and_a_phase_of_the_mix(tmp_path: Path) -> None:
    require("torch")
    out = tmp_path / "mix.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu.mix", "--configs", "1:off", "--model", "tiny",
         "--device", "cpu", "--chunks", "256", "--seconds", "2", "--tail", "0.5", "--load", "1",
         "--cold-rate", "8000", "--requests", "12", "--decode-batch", "2",
         "--decode-context", "128", "--repeats", "2", "--profile-after", "2",
         "--profile-iterations", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (config,) = json.loads(out.read_text())["configs"]
    assert config["mps_status"] == "off" and config["lost"] == 0
    (rank,) = config["ranks"]
    assert "error" not in rank and rank["decode_step_ms"] > 0 and rank["decode_floor_ms"] > 0
    (phase,) = rank["phases"]
    assert phase["chunk"] == 256 and phase["passes"] > 0 and phase["requests"] > 0
    timed = phase["iterations"]["all"]
    assert timed["count"] <= phase["passes"] and timed["wall_ms"] >= timed["issue_ms"]
    assert all(k in ("all", "decode", "prefill", "mixed") or "/" in k
               for k in phase["iterations"])
    assert "chunk 256: per worker" in run.stdout
