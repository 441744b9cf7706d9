"""The simulated engine's timing model: embedded fit, fit quality, iteration arithmetic."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from workers.engine.timing import (
    H200_LLAMA_1B,
    TIMING_MODELS,
    TimingModel,
    fit_timing,
    kv_bytes_per_token,
)

# Points whose measurements contradict their neighbours (module docstring): a cost that grows
# with work cannot pass within 25% of them, so they get a wider bound.
NOISY = {("prefill", 512, 0), ("prefill", 512, 1024), ("prefill", 64, 4096), ("prefill", 512, 8192)}


@pytest.fixture(scope="module")
def calibration_file() -> Path:
    return Path(__file__).resolve().parents[3] / "bench" / "data" / "h200_llama1b_random.json"


def test_embedded_coefficients_match_a_refit(calibration_file: Path) -> None:
    refit = fit_timing(calibration_file)
    for f in dataclasses.fields(TimingModel):
        assert getattr(refit, f.name) == pytest.approx(getattr(H200_LLAMA_1B, f.name), rel=1e-9), (
            f.name
        )


def test_predictions_track_every_calibration_point(calibration_file: Path) -> None:
    data = json.loads(calibration_file.read_text())
    points = [("prefill", p["new"], 0, p["ms"]) for p in data["prefill"]]
    points += [("prefill", p["new"], p["cached"], p["ms"]) for p in data["prefill_cached"]]
    points += [("decode", p["batch"], p["ctx"], p["ms"]) for p in data["decode"]]
    m = H200_LLAMA_1B
    for kind, a, b, ms in points:
        predicted = m.prefill_ms(a, b) if kind == "prefill" else m.decode_ms([b] * a)
        bound = 0.45 if (kind, a, b) in NOISY else 0.25
        assert abs(predicted / ms - 1) <= bound, (kind, a, b, ms, predicted)


def test_cached_prefix_makes_prefill_cheap() -> None:
    m = H200_LLAMA_1B
    assert m.prefill_ms(8192) == pytest.approx(38.09, abs=0.01)
    assert m.prefill_ms(64, 8192) == pytest.approx(5.55, abs=0.01)
    assert m.prefill_ms(8192) > 6 * m.prefill_ms(64, 8192)


def test_costs_grow_with_work() -> None:
    m = H200_LLAMA_1B
    assert all(getattr(m, f.name) >= 0 for f in dataclasses.fields(TimingModel))
    assert m.prefill_ms(1000) < m.prefill_ms(1001)
    assert m.prefill_ms(100, 1000) < m.prefill_ms(100, 2000)
    assert m.decode_ms([1000] * 8) < m.decode_ms([1000] * 9) < m.decode_ms([2000] * 9)


def test_iteration_pays_one_base_cost() -> None:
    m = TimingModel(
        prefill_base_ms=3.0,
        prefill_per_token_ms=0.01,
        prefill_per_token_sq_ms=0.001,
        prefill_per_token_cached_ms=0.0001,
        prefill_per_cached_ms=0.1,
        decode_base_ms=5.0,
        decode_per_seq_ms=0.5,
        decode_per_context_ms=0.01,
    )
    assert m.iteration_ms([], []) == 0.0
    # 3 + 0.01*100 + 0.001*100**2 + 0.0001*100*50 + 0.1*50 = 3 + 1 + 10 + 0.5 + 5
    assert m.prefill_ms(100, 50) == pytest.approx(19.5)
    # 5 + 2 * 0.5 + 0.01 * (10 + 30)
    assert m.decode_ms([10, 30]) == pytest.approx(6.4)
    # Mixed: the larger base once, plus each sequence's part.
    mixed = m.iteration_ms([(100, 50), (10, 0)], [10, 30])
    assert mixed == pytest.approx(5.0 + 16.5 + (0.1 + 0.1) + 1.4)


def test_negative_counts_are_refused() -> None:
    m = H200_LLAMA_1B
    with pytest.raises(ValueError, match=r"^prefill counts must be non-negative, got \(-1, 0\)$"):
        m.iteration_ms([(-1, 0)], [])
    with pytest.raises(ValueError, match=r"^decode context must be non-negative, got -5$"):
        m.iteration_ms([], [-5])
    with pytest.raises(ValueError, match=r"^need blocks >= 0 and block_size >= 1, got 1, 0$"):
        m.onboard_ms(1, 0)


def test_onboard_is_bandwidth_bound() -> None:
    assert kv_bytes_per_token(16, 8, 64) == 32 * 1024
    assert H200_LLAMA_1B.kv_bytes_per_token == 32 * 1024
    # 100 blocks * 16 tokens * 32 KiB = 52,428,800 bytes at 50 GB/s.
    assert H200_LLAMA_1B.onboard_ms(100, 16) == pytest.approx(1.048576)
    assert H200_LLAMA_1B.onboard_ms(0, 16) == 0.0
    halved = dataclasses.replace(H200_LLAMA_1B, kv_bytes_per_token=16 * 1024)
    assert halved.onboard_ms(100, 16) == pytest.approx(0.524288)


def test_fit_errors(tmp_path: Path) -> None:
    missing = tmp_path / "none.json"
    with pytest.raises(ValueError, match=rf"^cannot read calibration file {missing}: "):
        fit_timing(missing)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prefill": [{"new": 1}], "decode": []}))
    with pytest.raises(ValueError, match=r"^calibration data is malformed: missing or wrong field"):
        fit_timing(bad)
    few = tmp_path / "few.json"
    few.write_text(json.dumps({"prefill": [{"new": 1, "ms": 1.0}], "decode": []}))
    with pytest.raises(ValueError, match=r"^calibration needs 5 or more positive prefill timings$"):
        fit_timing(few)


def test_fit_recovers_exact_coefficients(tmp_path: Path) -> None:
    truth = TimingModel(
        prefill_base_ms=2.0,
        prefill_per_token_ms=0.002,
        prefill_per_token_sq_ms=3e-7,
        prefill_per_token_cached_ms=5e-7,
        prefill_per_cached_ms=1e-4,
        decode_base_ms=4.0,
        decode_per_seq_ms=0.05,
        decode_per_context_ms=1e-4,
    )
    news, cached = [128, 1024, 4096, 16384], [512, 4096]
    data = {
        "prefill": [{"new": n, "ms": truth.prefill_ms(n)} for n in news],
        "prefill_cached": [
            {"new": n, "cached": c, "ms": truth.prefill_ms(n, c)} for n in news for c in cached
        ],
        "decode": [
            {"batch": b, "ctx": c, "ms": truth.decode_ms([c] * b)}
            for b in (1, 8, 64)
            for c in cached
        ],
    }
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    fitted = fit_timing(path)
    for f in dataclasses.fields(TimingModel):
        assert getattr(fitted, f.name) == pytest.approx(getattr(truth, f.name), rel=1e-6), f.name


def test_paged_model_differs_from_the_calibration_only_in_decode_context() -> None:
    paged, calibrated = TIMING_MODELS["paged"], TIMING_MODELS["calibrated"]
    assert calibrated is H200_LLAMA_1B
    assert dataclasses.replace(paged, decode_per_context_ms=calibrated.decode_per_context_ms) \
        == calibrated
    # 64 sequences over 4k contexts: the calibration's 30 ms step, about 7 ms when paged.
    contexts = [4096] * 64
    assert calibrated.decode_ms(contexts) > 3 * paged.decode_ms(contexts)
    assert paged.decode_ms(contexts) > paged.decode_ms([1024] * 64)


def test_measured_model_differs_from_paged_only_in_prefill_over_a_cache() -> None:
    measured, paged = TIMING_MODELS["measured"], TIMING_MODELS["paged"]
    assert dataclasses.replace(
        measured, prefill_per_cached_ms=paged.prefill_per_cached_ms,
        prefill_per_token_cached_ms=paged.prefill_per_token_cached_ms) == paged
    assert measured.prefill_ms(512) == paged.prefill_ms(512)  # nothing cached: the same
    # 64 new over 8k cached: the calibration's 1.9 ms a read of the cache costs is gone
    assert paged.prefill_ms(64, 8192) - measured.prefill_ms(64, 8192) > 1.5
    assert measured.prefill_ms(64, 8192) > measured.prefill_ms(64)  # a cache still costs
    assert measured.decode_ms([4096] * 64) == paged.decode_ms([4096] * 64)
