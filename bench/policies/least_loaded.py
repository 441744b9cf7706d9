"""``least_loaded``: the worker with the fewest requests in flight (the router's own count),
ties at random."""

from __future__ import annotations

from bench.policies.base import ClusterView, Policy, RouteRequest, pick_min


class LeastLoaded(Policy):
    """Fewest in-flight requests routed by this router; ties at random."""

    name = "least_loaded"

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        self._active = [0] * cluster.num_workers
        self._where: dict[str, int] = {}

    def route(self, request: RouteRequest, now: float) -> int:
        worker = pick_min(self._active, self.cluster.rng)
        self._active[worker] += 1
        self._where[request.request_id] = worker
        return worker

    def finished(self, request_id: str, now: float) -> None:
        self._active[self._where.pop(request_id)] -= 1
