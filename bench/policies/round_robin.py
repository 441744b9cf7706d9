"""``round_robin``: worker 0, 1, ..., N-1, 0, ... regardless of anything."""

from __future__ import annotations

from bench.policies.base import ClusterView, Policy, RouteRequest


class RoundRobin(Policy):
    """Cycles through the workers in order."""

    name = "round_robin"

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        self._next = 0

    def route(self, request: RouteRequest, now: float) -> int:
        worker = self._next
        self._next = (worker + 1) % self.cluster.num_workers
        return worker
