"""Passes with prefill: cold, over a cached prefix, alone, and mixed with decode steps."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from bench.gpu.harness import (
    chunk,
    median_ms,
    plan_of,
    print_profiles,
    random_tokens,
    sync,
)
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.engine.executor import DecodeStep
from workers.torch.engine import TorchExecutor


def bench_ttft(args: argparse.Namespace, ex: TorchExecutor, cache: CacheManager) -> dict[str, Any]:
    """Passes with prefill (ms): cold 8k, 64 new over 8,128 cached, 64 new alone, and that
    cached pass mixed with 32 decode steps over 1,024-token contexts; each eager and (when the
    executor has them) padded into piecewise graphs, side by side in this one run."""
    rng = random.Random(1)
    n, cached = 8192, 8128
    long = random_tokens(rng, n)
    a = cache.allocate("ttft-long", Prompt(long))
    short = random_tokens(rng, n - cached)
    b = cache.allocate("ttft-short", Prompt(short))
    assert a is not None and b is not None, "the cache is too small for the ttft bench"
    steps = []
    for i in range(32):
        ctx = random_tokens(rng, 1024)
        alloc = cache.allocate(f"ttft-dec-{i}", Prompt(ctx))
        assert alloc is not None, "the cache is too small for the ttft bench"
        steps.append(DecodeStep(f"dec-{i}", tuple(alloc.block_ids), 1024, ctx[-1], 0,
                                Prompt(tuple(ctx))))
    cold = plan_of([chunk("cold", a.block_ids, long, 0)])
    warm = plan_of([chunk("warm", a.block_ids, long, cached)])
    alone = plan_of([chunk("alone", b.block_ids, short, 0)])
    mixed = plan_of([chunk("warm", a.block_ids, long, cached)], steps)
    piecewise = ex.piecewise
    out: dict[str, Any] = {}
    if piecewise is not None:
        # First use of a bucket captures its graphs: what the first such pass costs, once.
        first = plan_of([chunk("first", a.block_ids, long[:2000], 0)])
        for name, plan in (("new_64", alone), ("cached_64_with_32_decodes", mixed),
                           ("new_2000", first)):
            sync()
            t = time.perf_counter()
            ex.run(plan)
            sync()
            out[f"{name}_first_use_ms_piecewise"] = (time.perf_counter() - t) * 1e3
    for mode in ("eager", "piecewise") if piecewise is not None else ("eager",):
        ex.piecewise = piecewise if mode == "piecewise" else None
        suffix = "" if mode == "eager" else "_piecewise"
        out |= {
            f"cold_8192_ms{suffix}": median_ms(lambda: ex.run(cold), args.repeats),
            f"cached_8128_new_64_ms{suffix}": median_ms(lambda: ex.run(warm), args.repeats),
            f"new_64_alone_ms{suffix}": median_ms(lambda: ex.run(alone), args.repeats),
            f"cached_64_with_32_decodes_ms{suffix}": median_ms(
                lambda: ex.run(mixed), args.repeats
            ),
        }
    ex.piecewise = piecewise
    if args.profile:
        print_profiles(ex, {"cold 8192": cold, "cached 8128 + 64": warm})
    for rid in ("ttft-long", "ttft-short", *(f"ttft-dec-{i}" for i in range(32))):
        cache.free(rid)
    out["cached_over_alone"] = out["cached_8128_new_64_ms"] / out["new_64_alone_ms"]
    if "new_64_alone_ms_piecewise" in out:
        out["cached_over_alone_piecewise"] = (
            out["cached_8128_new_64_ms_piecewise"] / out["new_64_alone_ms_piecewise"]
        )
    out["cold_tokens_per_s"] = n / out["cold_8192_ms"] * 1e3
    return out
