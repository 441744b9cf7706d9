"""bench.gpu's attention, decode-context and prefill-context sections on the CPU (tiny
model): one entry per chunk shape that fits the cache, each timed; shapes past the cache are
left out, not failed."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.support.lazy import LazyModule, require
from workers.cache.cache_manager import CacheManager

require("torch")
# Imported by the first test that reads them: collecting this module imports no torch.
attention = LazyModule("bench.gpu.attention")
decode_context = LazyModule("bench.gpu.decode_context")
harness = LazyModule("bench.gpu.harness")
prefill_context = LazyModule("bench.gpu.prefill_context")
prompt = LazyModule("bench.gpu.prompt")


def test_attention_section_times_each_shape_that_fits_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = argparse.Namespace(model="tiny", device="cpu", repeats=2)
    ex = harness.executor(args, CacheManager(64, harness.BS))
    fits, too_long = (16, 40), (16, 64 * harness.BS)  # 2 blocks; 65 blocks of a 64-block cache
    monkeypatch.setattr(attention, "ATTENTION_SHAPES", (fits, too_long))
    rows = attention.bench_attention(args, ex)
    assert [(r["new"], r["cached"]) for r in rows] == [fits]
    assert rows[0]["ms"] > 0


def test_decode_context_section_times_both_ways_and_fits_a_cost_per_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = argparse.Namespace(model="tiny", device="cpu", repeats=2)
    ex = harness.executor(args, CacheManager(64, harness.BS))
    shapes = ((2, 64), (4, 256))
    monkeypatch.setattr(decode_context, "DECODE_CONTEXT_SHAPES", shapes)
    out = decode_context.bench_decode_context(args, ex)
    assert [(r["batch"], r["context"]) for r in out["shapes"]] == list(shapes)
    assert all(r["gathered_ms"] > 0 and r["in_place_ms"] > 0 for r in out["shapes"])
    assert out["layers"] == ex.model.config.num_layers
    assert isinstance(out["gathered_ns_per_token"], float)
    # The paged kernel (flex attention's decoding kernel) is timed on CUDA only.
    assert out["paged_ns_per_token"] is None and "paged_ms" not in out["shapes"][0]


def test_per_token_cost_is_the_slope_over_batch_times_context() -> None:
    rows = [{"batch": 1, "context": 1000, "ms": 1.0}, {"batch": 2, "context": 1000, "ms": 1.5},
            {"batch": 4, "context": 1000, "ms": 2.5}]
    # 0.5 ms per 1,000 tokens
    assert decode_context.per_token_ns(rows, "ms") == pytest.approx(500.0)
    assert decode_context.per_token_ns(rows[:1], "ms") is None


def test_prefill_context_section_times_each_shape_and_fits_the_cached_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = argparse.Namespace(model="tiny", device="cpu", repeats=2)
    ex = harness.executor(args, CacheManager(64, harness.BS))
    shapes = ((8, 0), (8, 64), (8, 256), (32, 0), (32, 256))
    monkeypatch.setattr(prefill_context, "PREFILL_CONTEXT_SHAPES", shapes)
    out = prefill_context.bench_prefill_context(args, ex)
    assert [(r["new"], r["cached"]) for r in out["shapes"]] == list(shapes)
    assert all(r["ms"] > 0 for r in out["shapes"])
    assert isinstance(out["per_cached_ms"], float)
    assert isinstance(out["per_token_cached_ms"], float)
    assert out["calibration_per_cached_ms"] > 0


def test_cached_costs_fit_the_time_a_cache_adds() -> None:
    # ms(n, c) = 1 + n / 1000 + 2e-4 * c + 1e-7 * n * c, exactly
    rows = [{"new": n, "cached": c, "ms": 1 + n / 1000 + 2e-4 * c + 1e-7 * n * c}
            for n in (64, 512) for c in (0, 1024, 8192)]
    a, b = prefill_context.cached_costs(rows)  # type: ignore[misc]
    assert a == pytest.approx(2e-4) and b == pytest.approx(1e-7)
    # without the n's cache-free row, nothing to subtract
    assert prefill_context.cached_costs([r for r in rows if r["new"] == 64 and r["cached"]]) is None


def test_the_entry_point_runs_the_decode_section_eager_on_the_cpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench.gpu.__main__ import main

    assert main(["--model", "tiny", "--device", "cpu", "--sections", "decode",
                 "--decode-steps", "4", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("\n{") + 1:])
    # No CUDA, so no graphs: one eager row per batch size.
    assert [(d["mode"], d["batch"]) for d in result["decode"]] == [
        ("eager", 1), ("eager", 8), ("eager", 32)]
    assert all(d["tokens_per_s"] > 0 for d in result["decode"])


def test_prompt_section_prefills_the_prompt_in_chunks_of_each_size_sampling_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = argparse.Namespace(model="tiny", device="cpu", repeats=1, prompt_tokens=100,
                              chunk_tokens="64,32")
    cache = CacheManager(64, harness.BS)
    ex = harness.executor(args, cache)
    free = cache.pool.num_free_blocks
    passes: list[tuple[int, int, bool]] = []
    run = ex.run

    def recording(plan):  # type: ignore[no-untyped-def]
        passes.extend((c.start, c.num_new_tokens, c.samples) for c in plan.prefill)
        return run(plan)

    monkeypatch.setattr(ex, "run", recording)
    out = prompt.bench_prompt(args, ex, cache)
    assert out["tokens"] == 100
    assert [(r["chunk"], r["passes"]) for r in out["chunks"]] == [(64, 2), (32, 4)]
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 for r in out["chunks"])
    by_64 = [(0, 64, False), (64, 36, True)]
    by_32 = [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    # one warm-up and one timed prompt per size, each covering positions 0..100 once
    assert passes == by_64 * 2 + by_32 * 2
    assert cache.pool.num_free_blocks == free
    assert "chunks of 32 (4 passes)" in prompt.prompt_lines(out)[1]


@pytest.mark.parametrize(("tokens", "chunks"), [(0, "64"), (100, "0"), (100, "64,x")])
def test_prompt_section_refuses_sizes_that_are_not_positive(tokens: int, chunks: str) -> None:
    args = argparse.Namespace(model="tiny", device="cpu", repeats=1, prompt_tokens=tokens,
                              chunk_tokens=chunks)
    cache = CacheManager(64, harness.BS)
    with pytest.raises(ValueError, match="must be positive"):
        prompt.bench_prompt(args, harness.executor(args, cache), cache)


def test_prompt_section_refuses_a_prompt_the_cache_cannot_hold() -> None:
    args = argparse.Namespace(model="tiny", device="cpu", repeats=1,
                              prompt_tokens=65 * harness.BS, chunk_tokens="64")
    cache = CacheManager(64, harness.BS)
    with pytest.raises(ValueError, match="does not fit"):
        prompt.bench_prompt(args, harness.executor(args, cache), cache)
