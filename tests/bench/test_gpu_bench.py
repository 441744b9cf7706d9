"""bench.gpu's attention section on the CPU (tiny model): one entry per chunk shape that fits
the cache, each timed; shapes past the cache are left out, not failed."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")

from bench import gpu
from workers.cache_manager import CacheManager


def test_attention_section_times_each_shape_that_fits_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = argparse.Namespace(model="tiny", device="cpu", repeats=2)
    ex = gpu._executor(args, CacheManager(64, gpu.BS))
    fits, too_long = (16, 40), (16, 64 * gpu.BS)  # 2 blocks; 65 blocks of a 64-block cache
    monkeypatch.setattr(gpu, "ATTENTION_SHAPES", (fits, too_long))
    rows = gpu.bench_attention(args, ex)
    assert [(r["new"], r["cached"]) for r in rows] == [fits]
    assert rows[0]["ms"] > 0
