"""One cold prompt prefilled alone, in chunks as a worker computes it: the isolated prefill
time a request's time to first token is judged against."""

from __future__ import annotations

import argparse
import random
from typing import Any

from bench.gpu.harness import median_ms, plan_of, random_tokens
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.engine.executor import PrefillChunk
from workers.torch.engine import TorchExecutor


def bench_prompt(args: argparse.Namespace, ex: TorchExecutor,
                 cache: CacheManager) -> dict[str, Any]:
    """``--prompt-tokens`` new tokens from position 0, one pass per chunk of each size in
    ``--chunk-tokens`` (each chunk over the K/V the ones before it wrote, the last one
    sampling), the passes back to back: median ms of ``--repeats`` whole prompts per size.

    Raises:
        ValueError: a chunk size that is not positive, or a prompt the cache cannot hold.
    """
    n = args.prompt_tokens
    try:
        sizes = [int(x) for x in str(args.chunk_tokens).split(",")]
    except ValueError:
        sizes = [0]
    if n < 1 or any(s < 1 for s in sizes):
        raise ValueError(f"--prompt-tokens and --chunk-tokens (comma-separated) must be "
                         f"positive, got {n} and {args.chunk_tokens}")
    tokens = random_tokens(random.Random(2), n)
    prompt = Prompt(tuple(tokens))
    alloc = cache.allocate("prompt", prompt)
    if alloc is None:
        raise ValueError(f"a {n}-token prompt does not fit the bench's cache")
    rows = []
    try:
        for size in sizes:
            plans = [plan_of([PrefillChunk("prompt", tuple(alloc.block_ids), s,
                                           min(size, n - s), tuple(tokens[s:s + size]), (),
                                           s + size >= n, 0, prompt)])
                     for s in range(0, n, size)]

            def prefill(plans: list[Any] = plans) -> None:
                for p in plans:
                    ex.run(p)

            ms = median_ms(prefill, args.repeats)
            rows.append({"chunk": size, "passes": len(plans), "ms": ms,
                         "tokens_per_s": n / ms * 1e3})
    finally:
        cache.free("prompt")
    return {"tokens": n, "chunks": rows}


def prompt_lines(p: dict[str, Any]) -> list[str]:
    """The section's lines of the text table."""
    return [f"cold prompt of {p['tokens']} tokens alone, chunks of {r['chunk']} "
            f"({r['passes']} passes): {r['ms']:.1f} ms, {r['tokens_per_s']:.0f} tok/s"
            for r in p["chunks"]]
