"""One layer's chunk attention: in place through the block table, or gathered first."""

from __future__ import annotations

import argparse
from typing import Any

from bench.gpu.harness import BS, median_ms
from workers.torch.engine import TorchExecutor

#: (new, cached) tokens of the attention section's chunks.
ATTENTION_SHAPES = ((64, 8128), (2048, 8192), (2048, 30720), (8192, 8192), (8192, 24576))


def bench_attention(args: argparse.Namespace, ex: TorchExecutor) -> list[dict[str, Any]]:
    """One layer's chunk attention by shape (ms): ``paged``, as :meth:`Decoder.attend` runs
    it (:func:`workers.torch.paged.paged_attention`: K/V read in place through the table), and
    ``gathered``, the blocks gathered first and flash attention run over them."""
    import torch

    from workers.torch import paged
    from workers.torch.model import PagedBatch, prefill_attention, prefill_views

    c, kv = ex.model.config, ex.kv.layers()[0]
    gen = torch.Generator(device="cpu").manual_seed(3)
    out = []
    for new, cached in ATTENTION_SHAPES:
        blocks = -(-(new + cached) // BS)
        if blocks > ex.kv.num_blocks:
            continue
        table = torch.randperm(ex.kv.num_blocks, generator=gen)[:blocks].to(kv.device)
        batch = PagedBatch(token_ids=torch.empty(0), positions=torch.empty(0),
                           slot_rows=torch.empty(0), prefill=((0, cached, new, table),),
                           decode_offset=new, decode_tables=None, decode_lens=None,
                           logit_rows=torch.empty(0))
        views = prefill_views(batch)
        q = torch.randn(new, c.num_heads, c.head_dim, generator=gen).to(kv)
        k = torch.empty(new, c.num_kv_heads, c.head_dim).to(kv)  # unread: K/V come from blocks
        attention = torch.empty_like(q)

        def attend() -> None:
            ex.model.attend(attention, q, k, k, kv, views, batch)  # noqa: B023

        def gathered() -> None:
            keys = kv[:, 0].index_select(0, table).flatten(0, 1)[: new + cached]  # noqa: B023
            values = kv[:, 1].index_select(0, table).flatten(0, 1)[: new + cached]  # noqa: B023
            attention.copy_(prefill_attention(q, keys, values))  # noqa: B023

        row = {"new": new, "cached": cached, "ms": median_ms(attend, args.repeats),
               "gathered_ms": median_ms(gathered, args.repeats)}
        if kv.device.type == "cuda":  # the kernel's launch for a chunk, by variant
            default = paged.PREFILL_CONFIG
            for config in PREFILL_VARIANTS:
                paged.PREFILL_CONFIG = config
                row["paged_{}_{}_{}_ms".format(*config)] = median_ms(attend, args.repeats)
            paged.PREFILL_CONFIG = default
        out.append(row)
    return out


#: (query tokens, warps, stages) of the chunk kernel the attention section times.
PREFILL_VARIANTS = ((16, 4, 2), (32, 4, 2), (32, 4, 3), (32, 8, 3), (16, 4, 3))
