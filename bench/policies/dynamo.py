"""``dynamo``: NVIDIA Dynamo's KV router with its documented defaults.

Per worker::

    cost = overlap_score_weight * prefill_blocks + decode_blocks
    prefill_blocks = in-flight prefill blocks + the request's blocks not cached there
    decode_blocks  = blocks held by requests decoding there

``overlap_score_weight`` 1.0, temperature 0: the minimum cost wins, ties at random. The
cached blocks come from the exact, event-fed index (host-tier matches credited 0.75, disk
would be 0.25). Load is the router's own prediction: a request's uncached blocks are added to
prefill when routed, move to decode (all its prompt blocks) at its first token, and are freed
when it ends (:class:`router.routing.load.LoadTracker` keeps exactly this lifecycle). Dynamo has no
prediction of residency before the events arrive: a burst sharing a new prefix sees no
overlap until the first request's blocks are reported.
"""

from __future__ import annotations

from bench.policies.base import ClusterView, Policy, RouteRequest, pick_min
from router.routing.load import LoadTracker


class Dynamo(Policy):
    """Dynamo's cost-based KV routing (module docstring).

    Args:
        overlap_score_weight: weight of prefill blocks against decode blocks.
        host_credit: credit of a host-tier matched block.
    """

    name = "dynamo"
    needs_index = True

    def __init__(self, overlap_score_weight: float = 1.0, host_credit: float = 0.75) -> None:
        self.overlap_score_weight = overlap_score_weight
        self.host_credit = host_credit

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        self._load = LoadTracker()
        for w in range(cluster.num_workers):
            self._load.add_worker(w)

    def route(self, request: RouteRequest, now: float) -> int:
        hashes = request.hashes
        index = self.cluster.index
        assert index is not None, "dynamo needs the event-fed index"
        matches = index.match(hashes) if hashes else {}
        blocks = len(hashes)
        costs, uncached = [], []
        for w in range(self.cluster.num_workers):
            any_tier, device = matches.get(w, (0, 0))
            new = blocks - (device + self.host_credit * (any_tier - device))
            load = self._load.load(w)
            uncached.append(new)
            costs.append(self.overlap_score_weight * (load.pending_prefill_blocks + new)
                         + load.decode_blocks)
        worker = pick_min(costs, self.cluster.rng)
        self._load.routed(request.request_id, worker, uncached[worker], max(blocks, 1))
        return worker

    def first_token(self, request_id: str, now: float) -> None:
        self._load.first_token(request_id)

    def finished(self, request_id: str, now: float) -> None:
        self._load.finished(request_id)
