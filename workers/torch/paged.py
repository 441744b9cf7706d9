"""Attention that reads K/V where they lie in the paged cache, through a block table.

Decode steps and prefill chunks over a cached prefix attend to context spread over KV blocks.
Gathering those blocks into one contiguous tensor first costs a write and a second read of
every context token, and memory that grows with the iteration's context (a million positions
of llama-1b is 2 GiB a layer). On CUDA, :func:`paged_attention` runs a Triton kernel written
here instead: each program takes a tile of queries of one sequence (the query heads that share
a KV head folded into its rows) and one share of the context, loads each K/V tile straight from
its block, and keeps an online softmax; when the context is split across programs
(flash-decoding, to fill the device when there are few queries), a second kernel combines the
shares by their maxima and sums. Nothing it allocates depends on the context's length.

Where Triton or CUDA is missing (the CPU), the same function gathers the blocks and calls
SDPA: the same result, the memory the gather takes. ``docs/gpu.md`` has the measurements
that chose this kernel over FlexAttention's paged decoding and over the gather.

The layout is :class:`workers.torch.kv.PagedKV`'s per-layer view ``[blocks, 2 (K, V),
block_size, kv_heads, head_dim]``; a table names each sequence's blocks in order, and position
``p`` of the sequence is offset ``p % block_size`` of block ``table[p // block_size]``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["decode_splits", "kernel_available", "paged_attention", "splits_for"]

#: Programs the split pass aims for: a few per multiprocessor of an H100/H200 (132).
TARGET_PROGRAMS = 528
#: Context positions one program step loads (K and V tiles of this many rows).
BLOCK_N = 64
#: A prefill chunk's launch: query tokens per program (times the heads that share a KV head
#: make its rows), warps, pipeline stages.
PREFILL_CONFIG = (16, 4, 2)
#: Most context splits per query tile.
MAX_SPLITS = 64


@functools.cache
def _triton() -> tuple[Any, ...] | None:  # triton, triton.language, the two kernels
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl, _build_kernel(triton, tl), _build_combine(triton, tl)


def kernel_available(device: torch.device) -> bool:
    """Whether :func:`paged_attention` runs the Triton kernel on ``device`` (CUDA with Triton
    installed); elsewhere it gathers."""
    return device.type == "cuda" and _triton() is not None


def splits_for(tiles: int, kv_heads: int, context: int) -> int:
    """How many shares of the context each query tile's program splits into: enough programs
    to fill the device (:data:`TARGET_PROGRAMS`), no share under :data:`BLOCK_N` positions.
    Decode graphs call it with their shape's widest context, so a shape's split is fixed."""
    want = -(-TARGET_PROGRAMS // max(1, tiles * kv_heads))
    return max(1, min(want, MAX_SPLITS, -(-context // BLOCK_N)))


def decode_splits(batch: int, kv_heads: int, max_context: int) -> int:
    """The split of a decode batch: :func:`splits_for` over the batch and context rounded up to
    powers of two, as a decode graph's shape rounds them (``workers.torch.graphs``). The split
    is a constant of the compiled kernel, so an unrounded one (a mixed pass's 18 decodes, say)
    would be a compile of its own in the middle of a pass; rounded, every decode batch uses a
    split the decode graphs compiled at start."""
    return splits_for(_pow2(batch), kv_heads, _pow2(max_context))


def paged_attention(q: Tensor, kv: Tensor, tables: Tensor, lens: Tensor, *, queries: int,
                    max_context: int, use_kernel: bool | None = None) -> Tensor:
    """Attention of ``q`` over paged K/V, causal from the bottom right.

    Two forms: decode (``queries == 1``), ``q [B, Hq, D]`` one token of each of B sequences,
    ``tables [B, W]``, ``lens [B]`` each sequence's context (its token included); and one
    prefill chunk (``queries == n``), ``q [n, Hq, D]`` the last n positions of one sequence,
    ``tables [1, W]``, ``lens [1]`` its context: query i sees positions up to
    ``lens - n + i``.

    Args:
        q: queries.
        kv: one layer's blocks ``[blocks, 2, block_size, kv_heads, head_dim]``.
        tables: block tables, int64, padded with any valid block.
        lens: context lengths, int64 on ``kv``'s device.
        queries: 1 for decode, else the chunk's new tokens.
        max_context: an upper bound of ``lens`` (sizes the split; host-side, so no sync).
        use_kernel: force the Triton kernel (True) or the gather (False); default the kernel
            where :func:`kernel_available`.

    Returns:
        ``[len(q), Hq, D]`` in ``q``'s dtype.
    """
    kernel = kernel_available(kv.device) if use_kernel is None else use_kernel
    if not kernel:
        return _gathered(q, kv, tables, lens, queries=queries)
    return _kernel(q, kv, tables, lens, queries=queries, max_context=max_context)


def _gathered(q: Tensor, kv: Tensor, tables: Tensor, lens: Tensor, *, queries: int) -> Tensor:
    """The reference: gather each table's blocks, then SDPA (what the CPU runs)."""
    b, hq, d = q.shape
    hkv = kv.shape[3]
    keys = kv[:, 0][tables].flatten(1, 2)  # [S, W * block_size, Hkv, D]
    values = kv[:, 1][tables].flatten(1, 2)
    positions = torch.arange(keys.shape[1], device=kv.device)
    if queries == 1:
        mask = positions[None, :] < lens[:, None]  # [B, ctx]
        out = F.scaled_dot_product_attention(
            q.view(b, hkv, hq // hkv, d), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None, None, :])
        return out.reshape(b, hq, d)
    # One chunk: query i sees positions < lens - n + i + 1.
    limits = lens[0] - queries + 1 + torch.arange(queries, device=kv.device)
    mask = positions[None, :] < limits[:, None]  # [n, ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[0].transpose(0, 1)[None], values[0].transpose(0, 1)[None],
        attn_mask=mask[None, None], enable_gqa=True)
    return out[0].transpose(0, 1)


def _kernel(q: Tensor, kv: Tensor, tables: Tensor, lens: Tensor, *, queries: int,
            max_context: int) -> Tensor:
    loaded = _triton()
    assert loaded is not None, "the kernel runs only where kernel_available() says so"
    kernel = loaded[2]
    n, hq, d = q.shape
    hkv, block_size = kv.shape[3], kv.shape[2]
    group = hq // hkv
    decode = queries == 1
    block_q, warps, stages = (1, 4, 2) if decode else PREFILL_CONFIG
    rows = max(16, _pow2(block_q * group))
    tiles = n if decode else -(-n // block_q)
    splits = (decode_splits(tiles, hkv, max_context) if decode
              else splits_for(tiles, hkv, max_context))
    out = torch.empty_like(q)
    keys, values = kv[:, 0], kv[:, 1]
    if splits > 1:
        part = torch.empty(tiles, splits, hkv, rows, d, dtype=torch.float32, device=q.device)
        stats = torch.empty(tiles, splits, hkv, rows, 2, dtype=torch.float32, device=q.device)
    else:
        part = stats = out  # unused: the kernel writes ``out`` itself
    kernel[(tiles, hkv, splits)](
        q, keys, values, out, part, stats, tables, lens, queries,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), tables.stride(0),
        1.0 / math.sqrt(d) * 1.4426950408889634,
        G=group, BLOCK_Q=block_q, M=rows, D=d, BS=block_size, BLOCK_N=BLOCK_N,
        SPLITS=splits, DECODE=decode, num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        combine = loaded[3]
        combine[(tiles, hkv, group if decode else rows)](
            part, stats, out, queries, out.stride(0), out.stride(1),
            G=group, BLOCK_Q=block_q, M=rows, D=d, SPLITS=splits, SPLITS_P2=_pow2(splits),
            DECODE=decode, num_warps=2,
        )
    return out


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


#: Integer arguments Triton must not specialize on (by default it compiles a variant for each
#: of "divisible by 16", "equal to 1" and neither): a block table's width and a chunk's queries
#: vary from pass to pass, so each new class would be a compile of its own (0.3-1 s) in the
#: middle of a pass that every running sequence waits for. The decode graphs captured at start
#: then compile every variant an eager pass can use.
_NOT_SPECIALIZED = ("n_queries", "stride_tab")


def _build_kernel(triton: Any, tl: Any) -> Any:  # Triton's modules; the jitted kernel
    @triton.jit(do_not_specialize=_NOT_SPECIALIZED)
    def paged_attention_kernel(
        Q, K, V, Out, Part, Stats, Tables, Lens, n_queries,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kp, stride_kh, stride_tab,
        scale_log2,
        G: tl.constexpr, BLOCK_Q: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
        BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, DECODE: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        rows = tl.arange(0, M)
        qi = rows // G
        g = rows % G
        dims = tl.arange(0, D)
        if DECODE:
            seq = tile
            n = 1
            first = tile  # the token's row in Q
            local = qi * 0  # every row is the sequence's one query
            token = tile + qi * 0
        else:
            seq = tile * 0
            n = n_queries
            first = tile * BLOCK_Q
            local = first + qi
            token = local
        ctx = tl.load(Lens + seq)
        valid = (qi < BLOCK_Q) & (local < n)
        limit = ctx - n + local + 1  # positions each row sees
        tile_limit = ctx - n + tl.minimum(first + BLOCK_Q, n)
        head = kvh * G + g
        q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=valid[:, None], other=0.0)
        steps = tl.cdiv(tl.cdiv(tile_limit, BLOCK_N), SPLITS)
        lo = split * steps * BLOCK_N
        hi = tl.minimum(lo + steps * BLOCK_N, tile_limit)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        table = Tables + seq.to(tl.int64) * stride_tab
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            inside = offs < hi
            block = tl.load(table + offs // BS, mask=inside, other=0).to(tl.int64)
            where = block * stride_kb + (offs % BS) * stride_kp + kvh * stride_kh
            k = tl.load(K + where[:, None] + dims[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            seen = (offs[None, :] < limit[:, None]) & inside[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            v = tl.load(V + where[:, None] + dims[None, :], mask=inside[:, None], other=0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLITS == 1:
            res = acc / l_i[:, None]
            tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     res.to(Out.dtype.element_ty), mask=valid[:, None])
        else:
            at = ((tile * SPLITS + split) * tl.num_programs(1) + kvh) * M + rows
            tl.store(Part + at[:, None] * D + dims[None, :], acc)
            tl.store(Stats + at * 2, m_i)
            tl.store(Stats + at * 2 + 1, l_i)

    return paged_attention_kernel


def _build_combine(triton: Any, tl: Any) -> Any:  # Triton's modules; the jitted kernel
    # One program per query row (a (tile, KV head, row) grid): every share's statistics and
    # partial output are loaded at once, as one [SPLITS_P2] vector and one [SPLITS_P2, D]
    # tile, instead of in a loop over the shares. The loop, one program per (tile, KV head),
    # was latency-bound: with few sequences (16 programs, 33 shares) it took longer than the
    # attention it combined (``docs/gpu.md``).
    @triton.jit(do_not_specialize=("n_queries",))
    def combine_shares_kernel(
        Part, Stats, Out, n_queries, stride_ot, stride_oh,
        G: tl.constexpr, BLOCK_Q: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
        SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, DECODE: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.program_id(2)
        heads = tl.num_programs(1)
        qi = row // G
        if DECODE:
            token = tile
            valid = qi < 1
        else:
            token = tile * BLOCK_Q + qi
            valid = (qi < BLOCK_Q) & (token < n_queries)
        if valid:
            shares = tl.arange(0, SPLITS_P2)
            real = shares < SPLITS
            at = ((tile * SPLITS + shares) * heads + kvh) * M + row
            top_each = tl.load(Stats + at * 2, mask=real, other=float("-inf"))
            sums = tl.load(Stats + at * 2 + 1, mask=real, other=0.0)
            top = tl.max(top_each, 0)
            top = tl.where(top == float("-inf"), 0.0, top)
            weight = tl.exp2(top_each - top)  # a share that saw nothing: 0
            total = tl.sum(weight * sums, 0)
            dims = tl.arange(0, D)
            part = tl.load(Part + at[:, None] * D + dims[None, :], mask=real[:, None], other=0.0)
            acc = tl.sum(weight[:, None] * part, 0)
            res = acc / tl.where(total == 0.0, 1.0, total)
            head = kvh * G + row % G
            tl.store(Out + token * stride_ot + head * stride_oh + dims,
                     res.to(Out.dtype.element_ty))

    return combine_shares_kernel
