"""Decode iterations at batch 1, 8 and 32 over 1,024-token prompts."""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from bench.gpu.harness import print_profiles, random_tokens
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.engine.batcher import Batcher, EngineRequest
from workers.torch.engine import TorchExecutor


def bench_decode(
    args: argparse.Namespace, ex: TorchExecutor, cache: CacheManager, batch: int
) -> dict[str, Any]:
    """Median decode iteration at ``batch`` requests of 1,024-token prompts."""
    rng = random.Random(batch)
    b = Batcher(cache, max_num_batched_tokens=8192, max_num_seqs=batch)
    steps = args.decode_steps
    for i in range(batch):
        b.add(
            EngineRequest(
                f"dec-{batch}-{i}", Prompt(random_tokens(rng, 1024)), steps + 4, ignore_eos=True
            )
        )
    times = []
    while (plan := b.schedule()) is not None:
        sampled, seconds = ex.run(plan)
        if not plan.prefill and len(plan.decode) == batch:
            times.append(seconds)
            last = plan
        b.complete(plan, sampled)
    if args.profile and batch == 8:
        print_profiles(ex, {"decode batch 8": last})
    ms = statistics.median(times[2:]) * 1e3
    return {"batch": batch, "ctx": 1024, "step_ms": ms, "tokens_per_s": batch / ms * 1e3}
