"""Decode attention of every layer against the bandwidth floor, and the whole decode step."""

from __future__ import annotations

import argparse
import random
from typing import Any

from bench.gpu.decode_context import flex_decode_ms
from bench.gpu.harness import BS, copy_bandwidth, graphed, median_ms, plan_of
from workers.cache.block_keys import Prompt
from workers.engine.executor import DecodeStep
from workers.torch.engine import TorchExecutor

#: (batch, context) shapes of the paged-decode section.
PAGED_DECODE_SHAPES = ((8, 8192), (8, 32768), (32, 8192), (32, 32768))


def bench_paged_decode(args: argparse.Namespace, ex: TorchExecutor) -> dict[str, Any]:
    """Decode at batch 8 and 32 over 8k and 32k contexts (CUDA): the attention of every
    layer three ways (the paged kernel, flex attention's paged decoding, the gather), each
    in ns per token of context beside the floor (each token's K/V read once, at the copy
    bandwidth measured here); and the whole decode step as the worker runs it (a replayed
    CUDA graph), ms. Random block tables over a pool larger than twice the K/V read."""
    import torch

    from workers.torch.paged import paged_attention

    c, device = ex.model.config, ex.kv.device
    dtype = ex.kv.layers()[0].dtype
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype.itemsize
    bandwidth = copy_bandwidth(device)
    torch.manual_seed(9)
    rows = []
    for batch, context in PAGED_DECODE_SHAPES:
        width = -(-context // BS)
        pool = max(4096, 2 * batch * width)
        kv = torch.randn(pool, 2, BS, c.num_kv_heads, c.head_dim, device=device, dtype=dtype)
        tables = torch.randint(0, pool, (batch, width), device=device)
        lens = torch.full((batch,), context, dtype=torch.long, device=device)
        q = torch.randn(batch, c.num_heads, c.head_dim, device=device, dtype=dtype)
        tokens = batch * context
        floor_ms = tokens * per_token / bandwidth * 1e3

        def attend(kernel: bool) -> None:
            for _ in range(c.num_layers):
                paged_attention(q, kv, tables, lens, queries=1,  # noqa: B023
                                max_context=width * BS, use_kernel=kernel)  # noqa: B023

        row: dict[str, Any] = {"batch": batch, "context": context, "floor_ms": floor_ms,
                               "kernel_eager_ms": median_ms(lambda: attend(True), args.repeats),
                               "kernel_ms": median_ms(graphed(lambda: attend(True)),
                                                       args.repeats)}
        try:
            row["gathered_ms"] = median_ms(lambda: attend(False), args.repeats)
        except torch.cuda.OutOfMemoryError:
            row["gathered_ms"] = None
        torch.cuda.empty_cache()
        try:
            row["flex_ms"] = flex_decode_ms(args, ex, batch, context)
        except Exception as exc:  # a compile failure is a finding, not a stop
            row["flex_error"] = repr(exc)[:200]
        torch.cuda.empty_cache()
        for key in ("kernel_ms", "kernel_eager_ms", "gathered_ms", "flex_ms"):
            if row.get(key) is not None:
                row[key.replace("_ms", "_ns_per_token")] = row[key] * 1e6 / tokens
        row["floor_ns_per_token"] = floor_ms * 1e6 / tokens
        row["kernel_over_floor"] = row["kernel_ms"] / floor_ms
        row["step_ms"] = decode_step_ms(args, ex, batch, context)
        rows.append(row)
    return {"bandwidth_gb_s": bandwidth / 1e9, "bytes_per_token": per_token, "shapes": rows}


def decode_step_ms(args: argparse.Namespace, ex: TorchExecutor, batch: int,
                    context: int) -> float:
    """One whole decode iteration of ``batch`` requests over ``context`` tokens each, their
    tables drawn at random from the executor's cache (ms, median)."""
    rng = random.Random(batch * context)
    width = -(-context // BS)
    blocks = ex.kv.num_blocks
    steps = [DecodeStep(f"s{i}", tuple(rng.randrange(blocks) for _ in range(width)), context,
                        5, 0, Prompt((5,))) for i in range(batch)]
    plan = plan_of((), steps)
    return median_ms(lambda: ex.run(plan), args.repeats)
