"""``sglang_cache_aware``: SGLang gateway's cache-aware policy, as its sources document it.

The rule, in the order it is applied to each request:

1. Load is the number of requests the gateway has in flight on each worker (incremented when
   routed, decremented when the response ends).
2. The cluster is *imbalanced* when ``max_load - min_load > balance_abs_threshold`` (64)
   AND ``max_load > balance_rel_threshold * min_load`` (1.5). Then the request goes to the
   least-loaded worker, and its prompt is still inserted into that worker's tree.
3. Otherwise the prompt is matched against the approximate tree: what the gateway itself
   routed, per worker (no engine events). If the longest match covers more than
   ``cache_threshold`` (0.3) of the prompt, the request goes to the worker holding it;
   else to the worker whose tree is smallest (most spare cache, in the gateway's belief).
4. The prompt is inserted under the chosen worker (refreshing its entries' access time).
5. Every ``eviction_interval_s`` (120 s), each worker's tree is cut back to
   ``max_tree_size`` (2**26) entries, least recently used first.

Boundaries: exactly 64 apart, or exactly 1.5x, is balanced (both comparisons are strict).
A match of exactly 30% is a miss (strict ``>``). A worker with load 0 and another with 65 is
imbalanced (65 > 1.5 x 0).

Reading choices (undocumented details, taken in the peer's favour):

- SGLang's tree is over characters; ours is over the prompt's router-local block hashes
  (32 tokens), so a match is counted in whole blocks: the match ratio differs from a
  character-level one by less than one block per request, and the tree's size is counted in
  tokens (blocks x block size) against ``max_tree_size``.
- When several workers hold the longest match, SGLang takes whichever its map yields first;
  we take the least loaded of them (ties at random), which can only help it.
"""

from __future__ import annotations

from collections import OrderedDict

from bench.policies.base import ClusterView, Policy, RouteRequest, pick_min


class SglangCacheAware(Policy):
    """SGLang's ``cache_aware`` policy with its documented defaults (module docstring).

    Args:
        cache_threshold: share of the prompt a match must exceed to follow it.
        balance_abs_threshold: load gap above which the cluster may be imbalanced.
        balance_rel_threshold: load ratio above which the cluster may be imbalanced.
        eviction_interval_s: seconds between tree evictions.
        max_tree_size: tokens each worker's tree keeps at an eviction.
    """

    name = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval_s: float = 120.0,
                 max_tree_size: int = 1 << 26) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        n = cluster.num_workers
        self._load = [0] * n
        self._where: dict[str, int] = {}
        self._trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]
        self._holders: dict[int, set[int]] = {}
        self._next_eviction = self.eviction_interval_s

    def imbalanced(self) -> bool:
        """Whether the load gap triggers the balance rule (rule 2)."""
        high, low = max(self._load), min(self._load)
        return (high - low > self.balance_abs_threshold
                and high > self.balance_rel_threshold * low)

    def route(self, request: RouteRequest, now: float) -> int:
        if now >= self._next_eviction:
            self._evict()
            self._next_eviction = now + self.eviction_interval_s
        hashes = request.hashes
        rng = self.cluster.rng
        if self.imbalanced():
            worker = pick_min(self._load, rng)
        else:
            run, holders = self._match(hashes)
            n_tokens = len(request.token_ids)
            if holders and run * request.block_size / n_tokens > self.cache_threshold:
                holders = sorted(holders)
                worker = holders[pick_min([self._load[w] for w in holders], rng)]
            else:
                worker = pick_min([len(t) for t in self._trees], rng)
        self._insert(worker, hashes)
        self._load[worker] += 1
        self._where[request.request_id] = worker
        return worker

    def finished(self, request_id: str, now: float) -> None:
        self._load[self._where.pop(request_id)] -= 1

    def _match(self, hashes: list[int]) -> tuple[int, set[int]]:
        """Return the longest leading run any worker's tree holds, and which workers hold it."""
        live: set[int] = set()
        run = 0
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            still = set(holders) if i == 0 else live & holders
            if not still:
                break
            live, run = still, i + 1
        return run, live

    def _insert(self, worker: int, hashes: list[int]) -> None:
        tree = self._trees[worker]
        for h in hashes:
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None
                self._holders.setdefault(h, set()).add(worker)

    def _evict(self) -> None:
        limit = max(1, self.max_tree_size // self.cluster.block_size)
        for worker, tree in enumerate(self._trees):
            while len(tree) > limit:
                h, _ = tree.popitem(last=False)
                holders = self._holders[h]
                holders.discard(worker)
                if not holders:
                    del self._holders[h]
