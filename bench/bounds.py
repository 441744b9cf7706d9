"""Hit-rate ceilings: what no router over the same caches can beat (by much).

Both bounds replay the workload in arrival order as if every request ran alone and at once,
counting hits in the same units as the simulated engine: a prompt of ``n`` tokens can hit at
most its first ``(n - 1) // block_size`` full blocks (the engine always computes the last
position), and after a request its prompt and output are cached up to the last computed
position (``n + output - 1`` tokens, full blocks only), as the workers cache generated tokens.

- **Unlimited**: one cache that never evicts. The share of prompt tokens whose leading blocks
  appeared in any earlier request: the workload's reuse, whatever the hardware.
- **Pooled LRU**: one LRU cache of ``workers x blocks_per_worker`` blocks. N separate caches
  of C blocks each, however requests are routed, hold no more than one pooled cache of N x C
  blocks; reaching this bound means routing lost (almost) nothing to the split. (It is not a
  strict bound: LRU is not an optimal replacement policy, and concurrency changes the order.)

Blocks are named by router-local chained hashes (:func:`indexer.index.block_hashes`), images by
their digests, exactly as the index names them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from bench.workloads import WorkloadRequest
from indexer.index import GLOBAL_SEED, block_hashes
from openai_request.prompts import PromptTokens
from router.routing.prompt_path import HashingTerms, request_hashes

__all__ = ["Bounds", "compute_bounds", "sequence_hashes"]


@dataclass(frozen=True, slots=True)
class Bounds:
    """Hit-rate ceilings in prompt tokens (hit tokens / prompt tokens)."""

    unlimited: float
    pooled_lru: float
    pooled_blocks: int
    prompt_tokens: int


def sequence_hashes(request: WorkloadRequest, block_size: int) -> tuple[list[int], int]:
    """Return the local hashes of the full blocks of the request's prompt plus output (up to
    its last computed position), and how many leading ones a prompt lookup may hit."""
    prompt = request.token_ids()
    n = len(prompt)
    seq = prompt + request.output_tokens()[:-1]
    full = len(seq) // block_size * block_size
    if request.images:
        hashes = request_hashes(PromptTokens(list(seq[:full]), list(request.images)),
                                HashingTerms(block_size))
    else:
        hashes = block_hashes(seq[:full], block_size, seed=GLOBAL_SEED)
    return hashes, (n - 1) // block_size


def _hits(requests: Sequence[WorkloadRequest], block_size: int
          ) -> Iterator[tuple[list[int], int]]:
    for r in requests:
        yield sequence_hashes(r, block_size)


def compute_bounds(requests: Sequence[WorkloadRequest], block_size: int, workers: int,
                   blocks_per_worker: int,
                   hashed: Sequence[tuple[list[int], int]] | None = None) -> Bounds:
    """Return the unlimited and pooled-LRU hit-rate ceilings of a workload.

    Args:
        requests: the workload, in arrival order.
        block_size: tokens per block.
        workers: workers in the cluster.
        blocks_per_worker: device blocks per worker.
        hashed: each request's :func:`sequence_hashes` at ``block_size``, when already
            computed (several cluster sizes over one workload hash it once).

    Raises:
        ValueError: no requests, or a non-positive size.
    """
    if not requests:
        raise ValueError("no requests")
    if block_size < 1 or workers < 1 or blocks_per_worker < 1:
        raise ValueError("block_size, workers and blocks_per_worker must be positive")
    capacity = workers * blocks_per_worker
    seen: set[int] = set()
    lru: OrderedDict[int, None] = OrderedDict()
    hit_unlimited = hit_pooled = total = 0
    hits = _hits(requests, block_size) if hashed is None else hashed
    for r, (hashes, hittable) in zip(requests, hits, strict=True):
        total += r.input_length
        run = 0
        while run < hittable and hashes[run] in seen:
            run += 1
        hit_unlimited += run * block_size
        run = 0
        while run < hittable and hashes[run] in lru:
            lru.move_to_end(hashes[run])
            run += 1
        hit_pooled += run * block_size
        seen.update(hashes)
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    return Bounds(hit_unlimited / total, hit_pooled / total, capacity, total)
