"""``random``: a uniformly random worker (seeded by the run)."""

from __future__ import annotations

from bench.policies.base import Policy, RouteRequest


class RandomPolicy(Policy):
    """Picks a worker uniformly at random."""

    name = "random"

    def route(self, request: RouteRequest, now: float) -> int:
        return self.cluster.rng.randrange(self.cluster.num_workers)
