"""A long prefill chunk's attention over its cached prefix, split into a cuDNN bulk and a
flash tail.

A chunk of n new tokens over c cached attends bottom-right causally over c + n positions.
Flash attention (PyTorch's SDPA kernel) runs it at ~290-300 TFLOP/s on the H200; cuDNN's
fused attention runs a plain (non-causal) product at ~420 (``docs/gpu.md``). So the context
is cut in two: the *bulk*, the first ``b`` cached positions (``b`` a multiple of
:data:`BULK_STEP`), which every new token sees whole, through cuDNN without a mask; and the
*tail*, the rest of the cached positions and the chunk itself, through flash, bottom-right
causal. The two partial results are merged by their log-sum-exps, exactly (up to rounding):
``out = (o1 e^l1 + o2 e^l2) / (e^l1 + e^l2)``.

cuDNN builds an execution plan per shape (~32 ms each on the H200 machine's host, in the
calling thread's cache), so its shapes are few and fixed: the queries are padded to a multiple
of :data:`QUERY_STEP` rows (the padded rows' outputs are dropped), the bulk is a multiple of
:data:`BULK_STEP` positions, and a worker builds every (rows, bulk) pair its settings allow
before it serves (:func:`bulk_shapes`, :meth:`workers.torch.engine.TorchExecutor.
prepare_chunks`). cuDNN's causal mask is top-left when a chunk's queries are fewer than its
keys, so the causal part stays with flash.

Where cuDNN's attention is missing (the CPU), chunks run whole through flash; the split and
the merge are the same code with other attention functions passed in, which is how the CPU
tests check them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["BULK_STEP", "MIN_NEW", "QUERY_STEP", "available", "bulk_for", "bulk_shapes",
           "query_rows", "split_attention"]

#: The bulk is a multiple of this many cached positions.
BULK_STEP = 4096
#: Chunks of fewer new tokens run whole through flash: at 1,024 new over 8,192 cached the split
#: measured no faster (0.395 against 0.390 ms a layer), at 2,048 it was 0.50 against 0.61.
MIN_NEW = 2048
#: cuDNN's queries are padded to a multiple of this many rows.
QUERY_STEP = 512

#: (q ``[1, Hq, rows, D]``, k, v ``[1, Hkv, positions, D]``) -> (out ``[1, Hq, rows, D]``,
#: natural log-sum-exp ``[1, Hq, rows]`` float32).
Attention = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@functools.cache
def available(device: torch.device) -> bool:
    """Whether chunks over a long cached prefix split their attention on ``device``."""
    return (device.type == "cuda" and torch.backends.cudnn.is_available()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))


def bulk_for(new: int, context: int) -> int:
    """Cached positions a chunk of ``new`` tokens seeing ``context`` positions sends through
    the bulk: the largest multiple of :data:`BULK_STEP` within its cached prefix, or 0 (the
    whole chunk through flash) below :data:`MIN_NEW` new tokens or one step cached."""
    if new < MIN_NEW:
        return 0
    return (context - new) // BULK_STEP * BULK_STEP


def query_rows(new: int) -> int:
    """The bulk's query rows for a chunk of ``new`` tokens (padded to :data:`QUERY_STEP`)."""
    return -(-new // QUERY_STEP) * QUERY_STEP


def bulk_shapes(max_new: int, max_context: int) -> list[tuple[int, int]]:
    """Every (query rows, bulk) pair chunks of at most ``max_new`` tokens over contexts of at
    most ``max_context`` positions can use: what a worker builds before it serves."""
    shapes = []
    for rows in range(query_rows(MIN_NEW), query_rows(max_new) + 1, QUERY_STEP):
        fewest = max(MIN_NEW, rows - QUERY_STEP + 1)  # the fewest new tokens padded to rows
        if fewest > max_new:
            break
        for bulk in range(BULK_STEP, bulk_for(fewest, max_context) + 1, BULK_STEP):
            shapes.append((rows, bulk))
    return shapes


def _heads_first(x: Tensor) -> Tensor:
    """``[S, H, D]`` contiguous as ``[1, H, S, D]``, its strides a function of its shape alone
    (cuDNN's plans are cached by shape and strides)."""
    s, h, d = x.shape
    return x.as_strided((1, h, s, d), (s * h * d, d, h * d, 1))


def cudnn_bulk(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """cuDNN's fused attention without a mask (an :data:`Attention`)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0,
                                                                  False)[:2]
    return out, lse.view(out.shape[:3])


def flash_tail(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Flash attention, causal from the bottom right (an :data:`Attention`)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]
    return out, lse


def split_attention(q: Tensor, keys: Tensor, values: Tensor, bulk: int, *,
                    bulk_attention: Attention = cudnn_bulk,
                    tail_attention: Attention = flash_tail) -> Tensor:
    """A chunk's attention, the bulk and the tail merged (module docstring).

    Args:
        q: ``[n, Hq, D]``, the last n of the context's positions.
        keys, values: ``[context, Hkv, D]``, contiguous.
        bulk: cached positions through the bulk (:func:`bulk_for`), at least one.

    Returns:
        ``[n, Hq, D]`` in ``q``'s dtype.
    """
    n, hq, d = q.shape
    padded = q.new_zeros(query_rows(n), hq, d)
    padded[:n] = q
    o1, l1 = bulk_attention(_heads_first(padded), _heads_first(keys[:bulk]),
                            _heads_first(values[:bulk]))
    o2, l2 = tail_attention(q.transpose(0, 1)[None], keys[bulk:].transpose(0, 1)[None],
                            values[bulk:].transpose(0, 1)[None])
    l1 = l1[:, :, :n]
    top = torch.maximum(l1, l2)
    w1 = torch.exp(l1 - top).unsqueeze(-1)
    w2 = torch.exp(l2 - top).unsqueeze(-1)
    out = (o1[:, :, :n] * w1 + o2 * w2) / (w1 + w2)
    return out[0].transpose(0, 1).to(q.dtype)


def warm(shapes: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
         dtype: torch.dtype, device: torch.device) -> int:
    """Run the bulk once at each shape in the calling thread, so that cuDNN's plans are built
    before a request needs them. Returns the shapes run."""
    if not shapes:
        return 0
    q = torch.zeros(max(r for r, _ in shapes), heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(max(b for _, b in shapes), kv_heads, head_dim, dtype=dtype, device=device)
    for rows, bulk in shapes:
        cudnn_bulk(_heads_first(q[:rows]), _heads_first(kv[:bulk]), _heads_first(kv[:bulk]))
    return len(shapes)
