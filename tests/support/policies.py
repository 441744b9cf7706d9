"""A stand-in for the simulation's cluster view, for policy tests without a simulation."""

from __future__ import annotations

import random

from bench.policies import WorkerMetrics
from indexer.index import PrefixIndex

#: The block size the policy tests use.
BS = 4


class FakeCluster:
    """Two workers (``roles``: each one's, both by default), 256 sequences and 1,000 blocks
    each, an empty index, fixed metrics."""

    def __init__(self, metrics: list[WorkerMetrics] | None = None,
                 roles: tuple[str, ...] = ("both", "both")) -> None:
        self.num_workers = 2
        self.roles = roles
        self.max_num_seqs = 256
        self.capacity_blocks = 1000
        self.block_size = BS
        self.index = PrefixIndex(BS)
        self.rng = random.Random(0)
        self.metrics = metrics or [WorkerMetrics(0, 0, 0.0), WorkerMetrics(0, 0, 0.0)]

    def worker_metrics(self, worker: int) -> WorkerMetrics:
        return self.metrics[worker]
