"""Decode attention of every layer by (batch, context): gathered, in place, paged."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from bench.gpu.harness import BS, median_ms
from workers.torch.engine import TorchExecutor

#: (batch, context) shapes of the decode-context section.
DECODE_CONTEXT_SHAPES = ((8, 4096), (32, 4096), (64, 4096), (64, 8192), (128, 4096),
                         (128, 8192), (256, 4096))


def bench_decode_context(args: argparse.Namespace, ex: TorchExecutor) -> dict[str, Any]:
    """Decode attention of every layer by (batch, context), two ways (ms, median of
    ``--repeats``, host time included): ``gathered``, each step's blocks gathered from a random
    block table, then masked attention (what runs without the paged kernel), and
    ``in_place``, attention over K/V already contiguous per sequence (flash attention, query
    heads folded by KV head as the engine folds them), the best a kernel that reads paged K/V
    in place can do; and on CUDA ``paged``, a real paged kernel (:func:`flex_decode_ms`).
    Also the least-squares cost per token of context (ns, all layers): the
    figure a simulated engine's ``decode_per_context_ms`` stands for. Shapes the device has
    no memory for are left out."""
    import torch

    torch.manual_seed(5)  # values drawn on the device: a CPU draw of 16 GB takes a minute
    rows, skipped = [], []
    for batch, context in DECODE_CONTEXT_SHAPES:
        try:
            row = _decode_attention_ms(args, ex, batch, context)
            if ex.kv.device.type == "cuda":
                row["paged_ms"] = flex_decode_ms(args, ex, batch, context)
            rows.append(row)
        except torch.cuda.OutOfMemoryError:
            skipped.append([batch, context])
        if ex.kv.device.type == "cuda":
            torch.cuda.empty_cache()
    paged = [r for r in rows if "paged_ms" in r]
    return {"layers": ex.model.config.num_layers, "shapes": rows, "out_of_memory": skipped,
            "gathered_ns_per_token": per_token_ns(rows, "gathered_ms"),
            "in_place_ns_per_token": per_token_ns(rows, "in_place_ms"),
            "paged_ns_per_token": per_token_ns(paged, "paged_ms")}


def _decode_attention_ms(args: argparse.Namespace, ex: TorchExecutor, batch: int,
                         context: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from workers.torch.paged import paged_attention

    c, device = ex.model.config, ex.kv.device
    on = {"device": device, "dtype": ex.kv.layers()[0].dtype}
    hkv, group, d = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
    width = -(-context // BS)
    pool = max(4096, 2 * batch * width)  # blocks the tables draw from: more than the L2 holds
    kv = torch.randn(pool, 2, BS, hkv, d, **on)
    tables = torch.randint(0, pool, (batch, width), device=device)
    lens = torch.full((batch,), width * BS, device=device)
    q = torch.randn(batch, c.num_heads, d, **on)
    # One contiguous K/V per layer, so that no layer reads what another left in the L2.
    keys = torch.randn(c.num_layers, batch, hkv, context, d, **on)
    values = torch.randn_like(keys)
    folded = q.view(batch, hkv, group, d)

    def gathered() -> None:  # the blocks gathered, then masked SDPA (no paged kernel)
        for _ in range(c.num_layers):
            paged_attention(q, kv, tables, lens, queries=1, max_context=width * BS,
                            use_kernel=False)

    def in_place() -> None:
        for layer in range(c.num_layers):
            F.scaled_dot_product_attention(folded, keys[layer], values[layer])

    return {"batch": batch, "context": context,
            "gathered_ms": median_ms(gathered, args.repeats),
            "in_place_ms": median_ms(in_place, args.repeats)}


def flex_decode_ms(args: argparse.Namespace, ex: TorchExecutor, batch: int,
                        context: int) -> float:
    """Decode attention of every layer through a kernel that reads paged K/V in place: flex
    attention (compiled to its decoding kernel) over a pool of ``BS``-token pages, each step's
    pages named by a random page table (CUDA only; ms, median of ``--repeats``)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    c, device = ex.model.config, ex.kv.device
    on = {"device": device, "dtype": ex.kv.layers()[0].dtype}
    pages = -(-context // BS)
    pool = batch * pages + 64
    keys = [torch.randn(1, c.num_kv_heads, pool * BS, c.head_dim, **on)
            for _ in range(c.num_layers)]
    values = [torch.randn_like(keys[0]) for _ in range(c.num_layers)]
    table = torch.randperm(pool, device=device)[: batch * pages].view(batch, pages)
    # kv_indices must span the pool's pages (the first kv_num_blocks of each row count).
    indices = torch.zeros(batch, 1, 1, pool, dtype=torch.int32, device=device)
    indices[:, 0, 0, :pages] = table
    mask = BlockMask.from_kv_blocks(
        torch.full((batch, 1, 1), pages, dtype=torch.int32, device=device), indices,
        BLOCK_SIZE=(128, BS), seq_lengths=(1, pool * BS), compute_q_blocks=False)
    q = torch.randn(batch, c.num_heads, 1, c.head_dim, **on)
    attend = torch.compile(flex_attention, dynamic=False)

    def paged() -> None:
        for layer in range(c.num_layers):
            attend(q, keys[layer], values[layer], block_mask=mask, enable_gqa=True)

    return median_ms(paged, args.repeats)


def per_token_ns(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """Slope of ``key`` (ms) over batch x context (tokens), least squares, in ns per token;
    None with fewer than two distinct sizes."""
    import numpy as np

    x = np.array([r["batch"] * r["context"] for r in rows], dtype=float)
    if len(set(x)) < 2:
        return None
    slope, _ = np.polyfit(x, np.array([r[key] for r in rows], dtype=float), 1)
    return float(slope * 1e6)
