"""The KV-aware cost rule: which worker serves a request. Pure: numbers in, a choice out.

Per candidate worker w, for a request of B full blocks (``docs/routing.md`` gives each term's
reason and measurements)::

    matched(w)  = device_matched(w) + host_credit * (matched_any_tier(w) - device_matched(w))
    prefill(w)  = (B - matched(w)) + queue_weight * pending_prefill_blocks(w)
    cost(w)     = overlap_weight * prefill(w) + decode_blocks(w)
                  + overlap_weight * session_weight * continue_rate
                    * (sessions(w) - min over candidates of sessions)

Sessions: a request that continues a session (``home``) goes to the session's worker unless
that worker's pending prefill exceeds the shortest queue among the candidates by more than
``session_queue_blocks``; then, and for every other request, the minimum cost wins. The session
term applies only to requests not kept home.

Choice: the minimum cost; ties go to fewer active requests, then at random (``rng``, seeded by
the caller, so tests are exact). No candidates is a caller error (the service answers 503 before
asking); a request with no full block (B = 0) is decided on load alone.

:func:`choose` prices every candidate (:func:`price`) and picks: the executable specification.
:mod:`router.routing.load_groups` reaches the same choice without pricing each worker that holds
nothing of the prompt; a differential test holds the two equal.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "Decision", "Pricing", "SchedulerConfig",
           "WorkerCost", "choose", "cost_of", "price", "select"]

@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler settings, frozen at start-up. These defaults are the router's
    (:class:`router.settings.RouterSettings` reads them from here).

    :meth:`dynamo` gives NVIDIA Dynamo's rule: overlap and queue weights 1, no session term.
    """

    overlap_weight: float = 32.0
    #: The fixed queue weight; under ``--queue-weight auto`` the router sets it per decision
    #: (:mod:`router.routing.pressure`).
    queue_weight: float = 0.5
    session_weight: float = 16.0
    #: A continuing session stays home unless its worker's pending prefill exceeds the
    #: shortest queue's by more than this many blocks (only when the caller passes ``home``).
    session_queue_blocks: float = 128.0
    #: Credit of a block matched on the host tier, which must be copied back before use
    #: (Dynamo's value).
    host_credit: float = 0.75

    def __post_init__(self) -> None:
        checks = [
            (self.overlap_weight >= 0, "overlap_weight must be >= 0"),
            (self.queue_weight >= 0, "queue_weight must be >= 0"),
            (self.session_weight >= 0, "session_weight must be >= 0"),
            (self.session_queue_blocks >= 0, "session_queue_blocks must be >= 0"),
            (0.0 <= self.host_credit <= 1.0, "host_credit must be in [0, 1]"),
        ]
        for ok, message in checks:  # a comparison with NaN is False: refused too
            if not ok:
                raise ValueError(message)

    @classmethod
    def dynamo(cls) -> SchedulerConfig:
        """NVIDIA Dynamo's rule: ``overlap * (uncached + queued prefill) + decode``."""
        return cls(overlap_weight=1.0, queue_weight=1.0, session_weight=0.0)


# Candidate and WorkerCost are built per priced worker per request on the hot path: plain
# slotted classes, since a frozen dataclass's __init__ costs an object.__setattr__ per field.
@dataclass(slots=True)
class Candidate:
    """One worker that may serve the request, with what the router knows of it."""

    worker: int
    matched_blocks: int = 0
    device_matched_blocks: int = 0
    pending_prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    active_requests: int = 0
    #: Live sessions homed here (:class:`router.routing.sessions.SessionTracker`).
    sessions: float = 0.0


@dataclass(slots=True, kw_only=True)
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
    sessions: float = 0.0


class Decision:
    """The chosen worker, its cost terms, and every candidate's, cheapest first.

    ``costs`` may be computed on first access (by the fast path, from the state then): a
    decision read at once, as ``/debug/route`` does, shows exactly the state it was made on.

    Args:
        worker: the chosen worker.
        costs: every candidate's terms, cheapest first; or None with ``explain``.
        overlap_weight: the weight the costs were priced at.
        chosen: the chosen worker's terms (found in ``costs`` when omitted).
        explain: computes ``costs`` when first read.
    """

    __slots__ = ("_chosen", "_costs", "_explain", "overlap_weight", "worker")

    def __init__(self, worker: int, costs: tuple[WorkerCost, ...] | None = None,
                 overlap_weight: float = 0.0, *, chosen: WorkerCost | None = None,
                 explain: Callable[[], tuple[WorkerCost, ...]] | None = None) -> None:
        if costs is None and explain is None:
            raise ValueError("a decision needs its costs or a way to compute them")
        self.worker = worker
        self.overlap_weight = overlap_weight
        self._costs = costs
        self._explain = explain
        self._chosen = chosen

    @property
    def costs(self) -> tuple[WorkerCost, ...]:
        """Every candidate's cost terms, cheapest first."""
        if self._costs is None:
            assert self._explain is not None
            self._costs, self._explain = self._explain(), None
        return self._costs

    @property
    def chosen(self) -> WorkerCost:
        """The cost terms of the chosen worker."""
        if self._chosen is None:
            self._chosen = next(c for c in self.costs if c.worker == self.worker)
        return self._chosen

    def __repr__(self) -> str:
        return f"Decision(worker={self.worker}, overlap_weight={self.overlap_weight})"


def cost_of(candidate: Candidate, request_blocks: int, config: SchedulerConfig) -> WorkerCost:
    """Return the cost terms of one candidate for a request of ``request_blocks`` blocks,
    without the session term."""
    matched = min(candidate.matched_blocks, request_blocks)
    device = min(candidate.device_matched_blocks, matched)
    credited = device + config.host_credit * (matched - device)
    prefill = (request_blocks - credited) + config.queue_weight * candidate.pending_prefill_blocks
    cost = config.overlap_weight * prefill + candidate.decode_blocks
    return WorkerCost(worker=candidate.worker, matched_blocks=matched,
                      device_matched_blocks=device, credited_blocks=credited,
                      prefill_blocks=prefill, decode_blocks=candidate.decode_blocks,
                      active_requests=candidate.active_requests, cost=cost,
                      sessions=candidate.sessions)


@dataclass(slots=True)
class Pricing:
    """Every candidate priced for one request (:func:`price`)."""

    #: Cost terms, cheapest first (ties: fewer active requests, then lower worker id).
    costs: list[WorkerCost]
    #: The weight prefill was priced at.
    overlap_weight: float
    #: The session's worker when the request stays home (no choice to make), else None.
    stay: int | None


def stays_home(home_pending: float, shortest: float, config: SchedulerConfig) -> bool:
    """Whether a continuing session stays on its worker, whose queue is ``home_pending``."""
    return home_pending - shortest <= config.session_queue_blocks


def price(request_blocks: int, candidates: Sequence[Candidate], config: SchedulerConfig,
          home: int | None = None, continue_rate: float = 1.0) -> Pricing:
    """Price every candidate for a request of ``request_blocks`` full blocks (module
    docstring; arguments as :func:`choose`)."""
    if not candidates:
        raise ValueError("no candidate workers")
    if request_blocks < 0:
        raise ValueError(f"request_blocks must be >= 0, got {request_blocks}")
    stay = None
    if home is not None:
        stay = next((c for c in candidates if c.worker == home), None)
        shortest = min(c.pending_prefill_blocks for c in candidates)
        if stay is not None and not stays_home(stay.pending_prefill_blocks, shortest, config):
            stay = None
    costs = [cost_of(c, request_blocks, config) for c in candidates]
    if config.session_weight > 0 and stay is None:
        fewest = min(c.sessions for c in candidates)
        session_price = config.overlap_weight * (config.session_weight * continue_rate)
        for wc in costs:
            wc.cost += session_price * (wc.sessions - fewest)
    costs.sort(key=lambda c: (c.cost, c.active_requests, c.worker))
    return Pricing(costs, config.overlap_weight, stay.worker if stay is not None else None)


def select(pricing: Pricing, rng: random.Random) -> int:
    """Pick the worker from a :class:`Pricing` (module docstring: stay, then ties)."""
    if pricing.stay is not None:
        return pricing.stay
    costs = pricing.costs
    best = costs[0]
    tied = [c.worker for c in costs
            if c.cost == best.cost and c.active_requests == best.active_requests]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def choose(request_blocks: int, candidates: Sequence[Candidate], config: SchedulerConfig,
           rng: random.Random, home: int | None = None, continue_rate: float = 1.0
           ) -> Decision:
    """Pick the worker for a request of ``request_blocks`` full blocks.

    Args:
        request_blocks: the prompt's full blocks (the ones the index can match).
        candidates: the workers that may serve it, with matches and load.
        config: the scheduler settings.
        rng: breaks ties.
        home: the worker the request's session lives on, if it continues one.
        continue_rate: the share of sessions that continue (weighs the session term).

    Returns:
        The decision, with every candidate's cost terms.

    Raises:
        ValueError: no candidates, or a negative block count.
    """
    pricing = price(request_blocks, candidates, config, home, continue_rate)
    worker = select(pricing, rng)
    return Decision(worker, tuple(pricing.costs), pricing.overlap_weight)

