"""Bounds on hand-made workloads: exact hit rates."""

from __future__ import annotations

from bench.bounds import compute_bounds
from bench.workloads import WorkloadRequest

A = tuple(range(10, 22))  # three blocks of 4: a1 a2 a3


def req(rid: str, tokens: tuple[int, ...], t: float) -> WorkloadRequest:
    # output_length 1: nothing generated is cached (the last sampled token is never computed).
    return WorkloadRequest(rid, t, (tokens,), len(tokens), 1)


def test_unlimited_counts_leading_blocks_seen_before_capped_one_token_short() -> None:
    b = (*A[:8], 90, 91, 92, 93)  # shares a1 a2
    reqs = [req("a", A, 0.0), req("b", b, 1.0), req("c", A, 2.0)]
    bounds = compute_bounds(reqs, block_size=4, workers=1, blocks_per_worker=100)
    # a: 0. b: a1 a2 = 8. c (= a, 12 tokens, block-aligned): at most (12-1)//4 = 2 blocks = 8.
    assert bounds.unlimited == 16 / 36
    assert bounds.pooled_lru == 16 / 36


def test_pooled_lru_evicts_least_recently_used_blocks() -> None:
    b = (*A[:8], 90, 91, 92, 93)
    reqs = [req("a", A, 0.0), req("b", b, 1.0)]
    # Two blocks pooled (2 workers x 1): after a, the LRU holds a2 a3 (a1 evicted), so b's
    # leading run is empty.
    bounds = compute_bounds(reqs, block_size=4, workers=2, blocks_per_worker=1)
    assert bounds.pooled_blocks == 2
    assert bounds.unlimited == 8 / 24
    assert bounds.pooled_lru == 0.0


def test_pooled_lru_hit_refreshes_recency() -> None:
    c = tuple(range(100, 104))
    reqs = [req("a", A[:5], 0.0), req("c", (*c, 1), 1.0), req("a2", A[:5], 2.0),
            req("d", tuple(range(200, 205)), 3.0), req("a3", A[:5], 4.0)]
    # Capacity 2 blocks. a: [a1]. c: [a1 c1]. a2 hits a1 (4), now [c1 a1]. d evicts c1:
    # [a1 d1]. a3 hits a1 (4). Unlimited: the same 8.
    bounds = compute_bounds(reqs, block_size=4, workers=1, blocks_per_worker=2)
    assert bounds.pooled_lru == 8 / 25
    assert bounds.unlimited == 8 / 25
