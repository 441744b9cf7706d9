"""The KV-aware scheduler: which worker serves a request. Pure: numbers in, a choice out.

The rule (``shared/DESIGN.md``), per candidate worker w, for a request of B full blocks::

    matched(w)  = device_matched(w) + host_credit * (matched_any_tier(w) - device_matched(w))
    prefill(w)  = (B - matched(w)) + queued(pending_prefill_blocks(w))
    queued(p)   = queue_weight * d + (p - d)
    d           = min(p, cap), the queue's discounted part; with queue_discount_cached_only,
                  at most matched(w) + continue_rate * (min(p, cap) - matched(w))
    cap         = queue_cap_blocks + min over candidates of pending_prefill_blocks
    cost(w)     = overlap_weight' * prefill(w) + decode_blocks(w)
                  + overlap_weight' * admission_weight * admission(w)
    overlap_weight' = overlap_weight * affinity_weight   if one candidate's matched blocks
                      lead every other's by affinity_lead_blocks or more (a continuing
                      session, whose conversation only its worker caches, or a prefix
                      only one worker holds)
                    = overlap_weight                     otherwise
    admission(w) = max(kv_excess(w), seq_excess(w) * kv_held(w) / active_requests(w))
    kv_excess(w)  = max(0, kv_held(w) + B - kv_shared(w) - kv_capacity_blocks(w))
                                                            (0 if the capacity is unknown)
    seq_excess(w) = max(0, active_requests(w) + 1 - max_running(w))   (0 if unknown)

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
- ``affinity_weight`` (1 here: no change; the router passes its ``--affinity-weight``, default
  4, and its ``--affinity-lead-blocks``, default 8) prices leaving the one worker that caches a
  request's conversation. ``overlap_weight`` 32 sets a block of decode context at 1/32 of a
  block to prefill, which is what the calibrated timing's decode costs (80.3 ns a token of
  context, K/V concatenated every step). An engine whose decode attention reads paged K/V in
  place (vLLM, TensorRT-LLM, SGLang) pays 8.9 ns a token on the same H200 (``docs/gpu.md``),
  so there the decode load that moved a session saved far less than the recompute cost.
  Raising ``overlap_weight`` itself for such engines also piles new sessions onto the workers
  holding their system prompt (the decode term is what spreads them), so the factor applies
  only where one worker clearly leads; ``docs/benchmarks.md`` ("The decode price, measured")
  and "The default engine" have the runs: 4 suits paged engines, 1 the calibrated timing; a
  lead of 8 met four more runs than 4 and broke none.
- ``queue_weight`` (default 0.5) scales the prefill already queued on a worker against the
  request's own uncached blocks: below 1 it prefers waiting behind a queue to recomputing a
  prefix elsewhere, since a recompute costs the whole cluster work (and duplicates the prefix,
  evicting something else) while a wait costs only this request. 1.0 is Dynamo's rule.
  ``queue_cap_blocks`` (default unbounded: the plain ``queue_weight * pending``) discounts
  only a queue's first blocks beyond the shortest queue among the candidates; the rest count
  at 1.0, so a low weight cannot pile traffic behind one worker without bound (the
  eviction-pressure rule, :mod:`router.pressure`). The cap counts from the shortest queue
  because what it stops is one worker's queue running away from the others': when every
  worker is backlogged alike, a recompute only adds to a backlog the whole cluster waits on.
  Measured (``docs/benchmarks.md``): counted from zero, the cap cost the overloaded 4-worker
  ``agentic`` runs 1-3 points of hit rate and up to 13% of TTFT p99 (``multi_turn`` there
  moved by under a point, its p99 either way); no trace or 8-worker run changed.
- ``queue_discount_cached_only`` (off here; the router turns it on while the caches warm up
  under ``--queue-weight auto``, :data:`router.pressure.ROUTER_PRESSURE_RULE`) limits that
  discount to what waiting saves: a request that waits behind a queue instead of recomputing
  elsewhere saves the cluster the blocks it finds cached there, and no more. A request no
  worker holds anything of (a new system prompt) used to weigh every queue at half, so it
  could land behind a long queue on the worker its hot neighbours stick to, and they then
  waited behind its prefill: a good part of the ``system_prompt`` tail. Only while the
  caches warm up (no eviction yet, under half full): once they evict, a recompute's duplicate
  evicts blocks others were about to hit, and capping the discount then cost the trace 1.6-2.1
  points of hit rate (91-95% of the pooled bound in three of four cells, against 96-102%).
  Where sessions continue the uncached rest of the queue keeps ``continue_rate`` of the
  discount: capped outright, the session workloads' TTFT p99 rose 2-3% (measured, not
  explained: their new sessions then left the workers holding their system prompt more
  often). ``docs/benchmarks.md``, "The queue discount while the caches warm up", has the
  runs.
- ``admission_weight`` (0 here by default: no term; the router passes 1) prices what the request
  would wait for *before* it is admitted, which the prefill terms do not see: a request whose
  prompt is mostly cached adds few pending-prefill blocks, yet it cannot start until the
  worker has KV for its whole prompt and a free sequence slot. ``kv_held`` is the KV the
  router estimates the worker's in-flight requests hold or will hold (the caller's estimate:
  the load books' decode plus waiting blocks, :meth:`router.load.LoadTracker.waiting_blocks`,
  or the distinct blocks of the in-flight prompts), ``kv_shared`` the request's blocks among
  them (an engine does not allocate a block twice); ``kv_excess`` is how many blocks must be
  freed (requests finishing) before this request fits in ``kv_capacity_blocks``;
  ``seq_excess`` is how many requests must finish before a slot frees under ``max_running``
  (the engine's ``max_num_seqs``), converted to blocks at the worker's mean ``kv_held`` per
  in-flight request, so both read "blocks that must finish decoding before this request
  starts". Both are in prefill-block units, hence ``overlap_weight``. A capacity or limit of
  0 means unknown: no such term. The slot half counts only while some candidate has a free
  slot (when all are full the wait is the same everywhere and the prefix decides). Measured
  (``bench.policies.kvroute_pressure`` ``kvroute_*admit*``, ``docs/benchmarks.md``): the slot
  half fixes the tail of a hot ``multi_turn`` worker at its 256 sequences and changes no
  other run checked, so the router fills it by default (``--admission-weight 1``); the KV
  half stays unfilled there, because the books' ``kv_held`` sums prompts, so a prefix shared
  by many in-flight requests is counted once per request (about 5x the distinct blocks on the
  generators) and the KV half then fires on phantom KV.

Sessions (:mod:`router.sessions`; the caller passes them, the router by default):

- ``home``: the worker a continuing session lives on (its previous request went there). The
  request goes there, whatever the costs, unless that worker's pending prefill exceeds the
  shortest queue among the candidates by more than ``session_queue_blocks``: then the costs
  decide, as for any request. This departs from ``shared/DESIGN.md``'s "pick the minimum"
  on purpose: every way of pricing the move (affinity factors, hysteresis, backlog gates)
  left the median to SGLang's stickier rule. Every candidate is still priced, for
  ``/debug/route`` and the order of fallbacks.
- ``sessions(w)``: the live sessions homed on a candidate. A request not kept home pays
  ``overlap_weight * session_weight * continue_rate * (sessions(w) - min sessions)`` more on
  each candidate (the configured overlap weight, not the affinity factor's), where
  ``continue_rate`` is the share of sessions that continued rather than ended. A chat or
  agent placed on a worker brings its later turns there, so the sessions a worker was given
  are load the decode and queue terms do not see yet.
- Why: without them, continuing turns left their worker whenever its queue was longer, each
  recomputing its conversation elsewhere, and new chats went where decode was lightest, so
  later turns piled up and left again; the extra prefill slowed every worker's iterations.
  Measured (``docs/benchmarks.md``, "Sessions"): the 4-worker ``multi_turn`` runs, whose
  medians went to SGLang's stickier rule, now meet every target, with lower tails.

Choice: temperature 0 picks the minimum cost; ties go to fewer active requests, then at random
(seeded by the caller, so tests are exact). Temperature T > 0 samples from
``softmax(-normalised_cost / T)`` with costs min-max normalised to [0, 1] across candidates, so
T means the same at any scale. Boundaries: no candidates is a caller error (the service
answers 503 before asking); a request with no full block (B = 0) is decided on load alone.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "Decision", "SchedulerConfig", "WorkerCost", "admission_blocks", "choose"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler settings (frozen at start-up)."""

    overlap_weight: float = 32.0
    host_credit: float = 0.75
    temperature: float = 0.0
    queue_weight: float = 0.5
    #: Only the first ``queue_cap_blocks`` of a worker's pending prefill are weighted at
    #: ``queue_weight``; blocks beyond count at 1.0 (Dynamo's weight). Unbounded by default.
    queue_cap_blocks: float = math.inf
    #: Discount at most the blocks the request finds cached on the worker (plus
    #: ``continue_rate`` of the rest); False (default) discounts the whole queue up to the cap.
    #: The router sets it while the caches warm up under ``--queue-weight auto``.
    queue_discount_cached_only: bool = False
    #: Weight of the admission term (blocks that must finish before this request is admitted,
    #: in prefill blocks); 0 (default) leaves it out: today's rule exactly.
    admission_weight: float = 0.0
    #: Multiplies ``overlap_weight`` for a request whose best-matched candidate holds at
    #: least ``affinity_lead_blocks`` more of it than every other; 1 (default) = no change.
    affinity_weight: float = 1.0
    affinity_lead_blocks: int = 4
    #: Price of a live session on a candidate, in prefill blocks (times the caller's
    #: ``continue_rate``), for a request not kept on its session's worker; 0 (default) = none.
    session_weight: float = 0.0
    #: A continuing session stays home unless its worker's pending prefill exceeds the
    #: shortest queue's by more than this many blocks (only when the caller passes ``home``).
    session_queue_blocks: float = 128.0

    def __post_init__(self) -> None:
        if self.overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {self.overlap_weight}")
        if self.queue_weight < 0:
            raise ValueError(f"queue_weight must be >= 0, got {self.queue_weight}")
        if not self.queue_cap_blocks >= 0:  # also rejects NaN
            raise ValueError(f"queue_cap_blocks must be >= 0, got {self.queue_cap_blocks}")
        if not self.admission_weight >= 0:  # also rejects NaN
            raise ValueError(f"admission_weight must be >= 0, got {self.admission_weight}")
        if not self.affinity_weight > 0:  # also rejects NaN
            raise ValueError(f"affinity_weight must be > 0, got {self.affinity_weight}")
        if self.affinity_lead_blocks < 1:
            raise ValueError(
                f"affinity_lead_blocks must be >= 1, got {self.affinity_lead_blocks}")
        if not self.session_weight >= 0:  # also rejects NaN
            raise ValueError(f"session_weight must be >= 0, got {self.session_weight}")
        if not self.session_queue_blocks >= 0:
            raise ValueError(
                f"session_queue_blocks must be >= 0, got {self.session_queue_blocks}")
        if not 0.0 <= self.host_credit <= 1.0:
            raise ValueError(f"host_credit must be in [0, 1], got {self.host_credit}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


# Candidate and WorkerCost are built per worker per request on the hot path: plain slotted
# classes, since a frozen dataclass's __init__ costs an object.__setattr__ per field.
@dataclass(slots=True)
class Candidate:
    """One worker that may serve the request, with what the router knows of it."""

    worker: int
    matched_blocks: int = 0
    device_matched_blocks: int = 0
    pending_prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    active_requests: int = 0
    #: KV blocks the worker's in-flight requests hold or will hold (router's estimate).
    kv_held_blocks: float = 0.0
    #: The request's blocks among those (not allocated twice).
    kv_shared_blocks: float = 0.0
    #: The worker's device KV blocks; 0 = unknown (no KV admission term).
    kv_capacity_blocks: float = 0.0
    #: The most requests the worker runs at once (``max_num_seqs``); 0 = unknown.
    max_running: int = 0
    #: Live sessions homed here (:class:`router.sessions.SessionTracker`).
    sessions: float = 0.0


@dataclass(slots=True)
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
    admission_blocks: float = 0.0
    sessions: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker and every candidate's cost terms, cheapest first, and the overlap
    weight they were priced at (the configured one, times ``affinity_weight`` for a led
    request)."""

    worker: int
    costs: tuple[WorkerCost, ...]
    overlap_weight: float = 0.0

    @property
    def chosen(self) -> WorkerCost:
        """The cost terms of the chosen worker."""
        return next(c for c in self.costs if c.worker == self.worker)


def cost_of(candidate: Candidate, request_blocks: int, config: SchedulerConfig,
            slot_free_elsewhere: bool = True, shortest_queue: float = 0.0,
            continue_rate: float = 1.0) -> WorkerCost:
    """Return the cost terms of one candidate for a request of ``request_blocks`` blocks
    (``slot_free_elsewhere``: as :func:`admission_blocks`; ``shortest_queue``: the least
    pending prefill among the candidates, where the queue cap counts from;
    ``continue_rate``: as :func:`choose`, for ``queue_discount_cached_only``)."""
    matched = min(candidate.matched_blocks, request_blocks)
    device = min(candidate.device_matched_blocks, matched)
    credited = device + config.host_credit * (matched - device)
    pending = candidate.pending_prefill_blocks
    discounted = min(pending, config.queue_cap_blocks + shortest_queue)
    if config.queue_discount_cached_only and discounted > credited:
        discounted = credited + continue_rate * (discounted - credited)
    queued = config.queue_weight * discounted + (pending - discounted)
    prefill = (request_blocks - credited) + queued
    cost = config.overlap_weight * prefill + candidate.decode_blocks
    admission = 0.0
    if config.admission_weight > 0 and (
            candidate.kv_capacity_blocks > 0
            or (slot_free_elsewhere and 0 < candidate.max_running <= candidate.active_requests)):
        admission = admission_blocks(candidate, request_blocks, slot_free_elsewhere)
        cost += config.overlap_weight * config.admission_weight * admission
    return WorkerCost(candidate.worker, matched, device, credited, prefill,
                      candidate.decode_blocks, candidate.active_requests, cost, admission,
                      candidate.sessions)


def admission_blocks(candidate: Candidate, request_blocks: int,
                     slot_free_elsewhere: bool = True) -> float:
    """Blocks that must finish on the candidate before a request of ``request_blocks`` is
    admitted there (``admission(w)`` in the module docstring). The slot half counts only while
    some worker has a free slot (``slot_free_elsewhere``): when all are full, waiting for a
    slot is the same everywhere and the prefix should decide."""
    held = candidate.kv_held_blocks
    kv = 0.0
    if candidate.kv_capacity_blocks > 0:
        kv = max(0.0, held + request_blocks - min(candidate.kv_shared_blocks, request_blocks)
                 - candidate.kv_capacity_blocks)
    seq = 0.0
    if slot_free_elsewhere and candidate.max_running > 0 and candidate.active_requests > 0:
        excess = candidate.active_requests + 1 - candidate.max_running
        if excess > 0:
            seq = excess * held / candidate.active_requests
    return max(kv, seq)


def choose(request_blocks: int, candidates: Sequence[Candidate], config: SchedulerConfig,
           rng: random.Random, home: int | None = None, continue_rate: float = 1.0
           ) -> Decision:
    """Pick the worker for a request of ``request_blocks`` full blocks.

    Args:
        request_blocks: the prompt's full blocks (the ones the index can match).
        candidates: the workers that may serve it, with matches and load.
        config: the scheduler settings.
        rng: the source of randomness for ties and temperature sampling.
        home: the worker the request's session lives on, if it continues one.
        continue_rate: the share of sessions that continue (weighs the session term).

    Returns:
        The decision, with every candidate's cost terms.

    Raises:
        ValueError: no candidates, or a negative block count.
    """
    if not candidates:
        raise ValueError("no candidate workers")
    if request_blocks < 0:
        raise ValueError(f"request_blocks must be >= 0, got {request_blocks}")
    free = False  # some worker has a free slot while another is full (the slot half's case)
    if config.admission_weight > 0:
        full = False
        for c in candidates:
            if c.max_running > 0:
                if c.active_requests < c.max_running:
                    free = True
                else:
                    full = True
        free = free and full
    base_weight = config.overlap_weight
    if config.affinity_weight != 1.0 and _led(request_blocks, candidates,
                                              config.affinity_lead_blocks):
        config = dataclasses.replace(
            config, overlap_weight=config.overlap_weight * config.affinity_weight)
    shortest = 0.0
    if config.queue_cap_blocks != math.inf or home is not None:
        shortest = min(c.pending_prefill_blocks for c in candidates)
    stay = None
    if home is not None:
        stay = next((c for c in candidates if c.worker == home), None)
        if stay is not None and stay.pending_prefill_blocks - shortest > \
                config.session_queue_blocks:
            stay = None
    costs = [cost_of(c, request_blocks, config, free, shortest, continue_rate)
             for c in candidates]
    if config.session_weight > 0 and stay is None:
        fewest = min(c.sessions for c in candidates)
        price = base_weight * (config.session_weight * continue_rate)
        for wc in costs:
            wc.cost += price * (wc.sessions - fewest)
    costs.sort(key=lambda c: (c.cost, c.active_requests, c.worker))
    if stay is not None:
        return Decision(stay.worker, tuple(costs), config.overlap_weight)
    if config.temperature > 0 and len(costs) > 1:
        worker = _sample(costs, config.temperature, rng)
    else:
        best = costs[0]
        tied = [c.worker for c in costs
                if c.cost == best.cost and c.active_requests == best.active_requests]
        worker = tied[0] if len(tied) == 1 else rng.choice(tied)
    return Decision(worker, tuple(costs), config.overlap_weight)


def _led(request_blocks: int, candidates: Sequence[Candidate], lead: int) -> bool:
    """Whether one candidate matches at least ``lead`` more of the request than every other."""
    if len(candidates) < 2:
        return False
    first = second = 0
    for c in candidates:
        m = min(c.matched_blocks, request_blocks)
        if m > first:
            first, second = m, first
        elif m > second:
            second = m
    return first - second >= lead


def _sample(costs: Sequence[WorkerCost], temperature: float, rng: random.Random) -> int:
    low, high = costs[0].cost, costs[-1].cost
    span = high - low
    if span <= 0:
        return rng.choice([c.worker for c in costs])
    weights = [math.exp(-((c.cost - low) / span) / temperature) for c in costs]
    return rng.choices([c.worker for c in costs], weights=weights, k=1)[0]
