"""Prefill attention of every layer by (new, cached), and the cost a cache adds."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from bench.gpu.harness import median_ms
from workers.torch.engine import TorchExecutor

#: (new, cached) shapes of the prefill-context section; each n also runs with nothing cached.
PREFILL_CONTEXT_SHAPES = ((64, 0), (64, 2048), (64, 8192), (64, 32768), (512, 0), (512, 2048),
                          (512, 8192), (512, 32768), (2048, 0), (2048, 8192), (2048, 32768))


def bench_prefill_context(args: argparse.Namespace, ex: TorchExecutor) -> dict[str, Any]:
    """Prefill attention of every layer by (new, cached), K/V contiguous per layer (ms, median
    of ``--repeats``, host time included), as :func:`workers.torch.model.prefill_attention`
    computes a chunk; then :func:`cached_costs` of the rows, beside the calibration's fit
    (:data:`workers.engine.timing.H200_LLAMA_1B`). Shapes the device has no memory for are left
    out."""
    import torch

    from workers.engine.timing import H200_LLAMA_1B

    torch.manual_seed(7)
    rows, skipped = [], []
    for new, cached in PREFILL_CONTEXT_SHAPES:
        try:
            rows.append({"new": new, "cached": cached,
                         "ms": _prefill_context_ms(args, ex, new, cached)})
        except torch.cuda.OutOfMemoryError:
            skipped.append([new, cached])
        if ex.kv.device.type == "cuda":
            torch.cuda.empty_cache()
    fit = cached_costs(rows)
    return {"layers": ex.model.config.num_layers, "shapes": rows, "out_of_memory": skipped,
            "per_cached_ms": fit and fit[0], "per_token_cached_ms": fit and fit[1],
            "calibration_per_cached_ms": H200_LLAMA_1B.prefill_per_cached_ms,
            "calibration_per_token_cached_ms": H200_LLAMA_1B.prefill_per_token_cached_ms}


def _prefill_context_ms(args: argparse.Namespace, ex: TorchExecutor, new: int,
                        cached: int) -> float:
    import torch

    from workers.torch.model import prefill_attention

    c = ex.model.config
    on = {"device": ex.kv.device, "dtype": ex.kv.layers()[0].dtype}
    q = torch.randn(new, c.num_heads, c.head_dim, **on)
    # One K/V per layer, so that no layer reads what another left in the L2.
    keys = [torch.randn(cached + new, c.num_kv_heads, c.head_dim, **on)
            for _ in range(c.num_layers)]
    values = [torch.randn_like(k) for k in keys]

    def attend() -> None:
        for k, v in zip(keys, values, strict=True):
            prefill_attention(q, k, v)

    return median_ms(attend, args.repeats)


def cached_costs(rows: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """Least squares of the time a cache adds, ``ms(n, c) - ms(n, 0) = a * c + b * n * c``,
    over the rows with c > 0 whose n also ran with nothing cached: ``(a, b)`` in ms per cached
    token and per new x cached token pair; None with fewer than two such rows."""
    import numpy as np

    alone = {r["new"]: r["ms"] for r in rows if r["cached"] == 0}
    extra = [(r["cached"], r["new"] * r["cached"], r["ms"] - alone[r["new"]])
             for r in rows if r["cached"] > 0 and r["new"] in alone]
    if len(extra) < 2:
        return None
    x = np.array([[c, nc] for c, nc, _ in extra], dtype=float)
    (a, b), *_ = np.linalg.lstsq(x, np.array([e for *_, e in extra], dtype=float), rcond=None)
    return float(a), float(b)
