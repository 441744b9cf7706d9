"""The KV-aware scheduler: which worker serves a request. Pure: numbers in, a choice out.

The rule (``shared/DESIGN.md``), per candidate worker w, for a request of B full blocks::

    matched(w)  = device_matched(w) + host_credit * (matched_any_tier(w) - device_matched(w))
    prefill(w)  = (B - matched(w)) + queue_weight * pending_prefill_blocks(w)
    cost(w)     = overlap_weight * prefill(w) + decode_blocks(w)

- ``matched`` is the leading run of the prompt's blocks the worker holds (index, plus blocks
  predicted resident because the router just sent a request with that prefix there). A block
  on the host tier must be copied back before use, so it is credited ``host_credit`` (0.75 by
  default, as Dynamo does) of a device block.
- ``pending_prefill_blocks`` is prefill work already queued there (routed, first token not
  yet out); ``decode_blocks`` the KV blocks held by requests decoding there. Both come from
  the router's own accounting, corrected by the worker's reported load (:mod:`router.load`).
- ``overlap_weight`` trades cache against load: above 1 prefers hits (TTFT), below 1 prefers
  spreading (throughput). Default 32, tuned on ``bench.replay`` (``docs/benchmarks.md``): on
  the calibrated H200 timing a block held by a decoding request costs about 30 times less
  than a block to prefill, and at Dynamo's 1.0 the router moved requests off workers with long
  decodes and recomputed their long prefixes elsewhere (multi-turn hit rate 76% -> 89%, p50
  TTFT .28 -> .13 s at 32). ``--overlap-weight 1`` gives Dynamo's rule.
- ``queue_weight`` (default 0.5) scales the prefill already queued on a worker against the
  request's own uncached blocks: below 1 it prefers waiting behind a queue to recomputing a
  prefix elsewhere, since a recompute costs the whole cluster work (and duplicates the prefix,
  evicting something else) while a wait costs only this request. 1.0 is Dynamo's rule.

Choice: temperature 0 picks the minimum cost; ties go to fewer active requests, then at random
(seeded by the caller, so tests are exact). Temperature T > 0 samples from
``softmax(-normalised_cost / T)`` with costs min-max normalised to [0, 1] across candidates, so
T means the same at any scale. Boundaries: no candidates is a caller error (the service
answers 503 before asking); a request with no full block (B = 0) is decided on load alone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "Decision", "SchedulerConfig", "WorkerCost", "choose"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler settings (frozen at start-up)."""

    overlap_weight: float = 32.0
    host_credit: float = 0.75
    temperature: float = 0.0
    queue_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {self.overlap_weight}")
        if self.queue_weight < 0:
            raise ValueError(f"queue_weight must be >= 0, got {self.queue_weight}")
        if not 0.0 <= self.host_credit <= 1.0:
            raise ValueError(f"host_credit must be in [0, 1], got {self.host_credit}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker that may serve the request, with what the router knows of it."""

    worker: int
    matched_blocks: int = 0
    device_matched_blocks: int = 0
    pending_prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    active_requests: int = 0


@dataclass(frozen=True, slots=True)
class WorkerCost:
    """The terms of one candidate's cost, as ``/debug/route`` shows them."""

    worker: int
    matched_blocks: int
    device_matched_blocks: int
    credited_blocks: float
    prefill_blocks: float
    decode_blocks: float
    active_requests: int
    cost: float


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker and every candidate's cost terms, cheapest first."""

    worker: int
    costs: tuple[WorkerCost, ...]

    @property
    def chosen(self) -> WorkerCost:
        """The cost terms of the chosen worker."""
        return next(c for c in self.costs if c.worker == self.worker)


def cost_of(candidate: Candidate, request_blocks: int, config: SchedulerConfig) -> WorkerCost:
    """Return the cost terms of one candidate for a request of ``request_blocks`` blocks."""
    matched = min(candidate.matched_blocks, request_blocks)
    device = min(candidate.device_matched_blocks, matched)
    credited = device + config.host_credit * (matched - device)
    prefill = (request_blocks - credited) + config.queue_weight * candidate.pending_prefill_blocks
    cost = config.overlap_weight * prefill + candidate.decode_blocks
    return WorkerCost(candidate.worker, matched, device, credited, prefill,
                      candidate.decode_blocks, candidate.active_requests, cost)


def choose(request_blocks: int, candidates: Sequence[Candidate], config: SchedulerConfig,
           rng: random.Random) -> Decision:
    """Pick the worker for a request of ``request_blocks`` full blocks.

    Args:
        request_blocks: the prompt's full blocks (the ones the index can match).
        candidates: the workers that may serve it, with matches and load.
        config: the scheduler settings.
        rng: the source of randomness for ties and temperature sampling.

    Returns:
        The decision, with every candidate's cost terms.

    Raises:
        ValueError: no candidates, or a negative block count.
    """
    if not candidates:
        raise ValueError("no candidate workers")
    if request_blocks < 0:
        raise ValueError(f"request_blocks must be >= 0, got {request_blocks}")
    costs = sorted((cost_of(c, request_blocks, config) for c in candidates),
                   key=lambda c: (c.cost, c.active_requests, c.worker))
    if config.temperature > 0 and len(costs) > 1:
        worker = _sample(costs, config.temperature, rng)
    else:
        best = costs[0]
        tied = [c.worker for c in costs
                if c.cost == best.cost and c.active_requests == best.active_requests]
        worker = tied[0] if len(tied) == 1 else rng.choice(tied)
    return Decision(worker, tuple(costs))


def _sample(costs: Sequence[WorkerCost], temperature: float, rng: random.Random) -> int:
    low, high = costs[0].cost, costs[-1].cost
    span = high - low
    if span <= 0:
        return rng.choice([c.worker for c in costs])
    weights = [math.exp(-((c.cost - low) / span) / temperature) for c in costs]
    return rng.choices([c.worker for c in costs], weights=weights, k=1)[0]
