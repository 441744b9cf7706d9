"""The routing rule: price each candidate by the time to first token it would give, in
seconds, plus the time its prefill passes on when the fleet has no idle worker; choose the
least. Pure: numbers in, a choice out.

Per candidate worker w, for a request of B full blocks, with w's rates per block
(:class:`router.routing.rates.Rates`, already multiplied by w's learned factor)::

    matched(w) = the leading run of the prompt's blocks w holds, any tier (at most B)
    host(w)    = matched(w) - the part of it on the device
    new(w)     = B - matched(w)
    prefill(w) = prefill_s * new + context_s * new * (matched + new / 2) + onboard_s * host
    wait(w)    = the seconds of prefill queued there (each routed request's own prefill,
                 booked when it was routed; the oldest one's less what w's KV events show
                 it has stored, :mod:`router.routing.load`) + decode_s * decode blocks
                 held there
    ttft(w)    = wait(w) + prefill(w) + first_s
    price(w)   = ttft(w) + n(w) * prefill(w)   if every candidate has a wait (a busy fleet)
                 ttft(w)                        if some candidate is idle
    n(w)       = 1 + the fleet's mean count of requests prefilling per worker
                                                if w has a request of ours prefilling
                 1                              if not

The ``n(w) * prefill(w)`` is the time the request passes on. While some worker is idle, a
later request can be sent there, and the seconds of prefill this one adds delay nobody. When
every worker has work queued, a later request waits behind some queue whatever the router
does, and each second of prefill queued anywhere is a second each request queued behind it
waits. How many will queue behind it: about as many as a request finds ahead of it, which in
a fleet kept level by the router is the fleet's mean queue (n - 1), and at least the one
that comes next. A worker with no prefill queued (idle or only decoding) starts this one at
once, and only the next request there would wait for it: n = 1. This is what keeps one
copy of a prefix in a busy fleet: recomputing a long prefix elsewhere is dear n + 1 times
over, while a hit adds little work. ``WorkerCost.cost`` stays the predicted time to first
token (what the router books and what flow control reads); ``WorkerCost.price`` is what the
choice minimises.

**A TTFT objective** (``slo``, seconds; the router's ``--ttft-slo``, none by default). The
operator states the time to first token its clients accept; in a busy fleet the rule then
spends that time on the fleet's work. A candidate whose predicted TTFT is within the objective
is priced by its own prefill alone (what it adds to the fleet's work; the wait, within the
objective, costs the client nothing it has not accepted), and ties between such candidates
go to the sooner TTFT; a candidate beyond it keeps the price above, which is more than the
objective, so one within it always wins. With an idle candidate nothing changes: nothing is
passed on, and the price is the TTFT (invariant 2 holds with or without an objective)::

    price(w) = prefill(w)                       busy, objective set, ttft(w) <= slo
                                                (ties: the least ttft(w))

**A peer fetch** (:mod:`router.routing.fetch_links`; ``docs/peer_fetch.md``). A worker w
that receives fetches may, instead of recomputing what it lacks, pull the leading blocks a
holder s that serves reads keeps on its device (``held(s) > matched(w)``) and prefill only
the rest. Each such source is a third option for w, beside recomputing and beside sending
the request to s (which is s's own candidate and price)::

    transfer(w, s) = read_s + (held(s) - matched(w)) * block_s(s, w)
    fetched(w, s)  = prefill_s * new' + context_s * new' * (held + new' / 2) + onboard_s * host
                     with new' = B - held(s)
    ttft(w, s)     = wait(w) + transfer(w, s) + fetched(w, s) + first_s
    price(w, s)    = ttft(w, s) + n(w) * fetched(w, s)   busy
                     fetched(w, s)                       busy, objective set, ttft(w, s) <= slo
                     ttft(w, s)                          some candidate idle

``block_s(s, w)`` is the seconds a block takes over the pair's link (learned from the
fetches' results) and never less than w's ``onboard_s``: a fetched block lands on the device
through a copy at least as dear as a host one. The transfer is in the time to first token
but not in what is passed on: it occupies the link and the source's reads, not w's compute,
so a later request queued on w waits for w's prefill, not for its transfer. The prefill a
fetch saves is the fleet work it does not pass on. What a fetch may pass on instead is its
copy: the blocks it inserts evict others from w's cache once the caches are full, and those
are recomputed later. A busy fleet prices that as ``pressure`` (the fleet's eviction
pressure, :mod:`router.routing.pressure`, at most 1: the share of its caches evicted in the
window) times the copied blocks' prefill, passed on with the rest::

    price(w, s)    = ttft(w, s) + n(w) * (fetched(w, s) + pressure * prefill of the copy)
                                                         busy, beyond any objective

so where nothing is evicted a copy is free, and where the caches turn over whole it costs the
fleet what recomputing it would. w's price is its cheapest option (by
``WorkerCost.rank``; a tie goes to recomputing, then to the source listed first).

Choice: the least ``price``; ties go to the least TTFT among candidates within an objective,
then to fewer active requests, then at random (``rng``, seeded by the caller, so tests are
exact). No candidates is a caller error (the service answers 503
before asking); a request with no full block (B = 0) is decided on the waits alone.

Invariants (``tests/router/routing/test_rule_invariants.py`` checks them for :func:`choose` and
:func:`router.routing.load_groups.choose_fast` on random fleets):

1. Of two idle workers with the same rates, one holding more of the prompt, and no less of it
   on the device, is never priced above the other: a block held saves at least ``prefill_s
   - onboard_s >= 0`` (:class:`~router.routing.rates.Rates` refuses a dearer copy than a
   recompute) and the attention over it. (A worker holding more only on the host tier may
   cost more than one holding a little less on the device: the copies are dearer.) Their
   price is their ``ttft``: with an idle candidate nothing is passed on.
2. A worker whose wait exceeds the time to recompute the whole prompt on an idle candidate is
   never chosen over it: with an idle candidate the price is the ``ttft``, and the queued
   one's is at least its wait, the idle one's at most that recompute (with the same
   ``first_s``).
3. With an objective, in a busy fleet, a candidate predicted within it is never passed over
   for one predicted beyond it, and no candidate within it has less prefill of its own than
   the one chosen: within it, a price is a prefill, at most the TTFT, at most the objective;
   beyond it a price is at least the TTFT, more than the objective.
4. A fetch is never chosen for a worker whose recompute is no dearer there (its price is
   the least of its options, ties to recomputing), never from a worker that does not serve
   reads or whose link to it is backed off (such a worker is no source), and never of fewer
   blocks than the worker holds itself.

With fetches, 1 holds as stated when the two workers have the same link from each source
(the copy floor on ``block_s`` makes a block the one holding more has on its host tier no
dearer to it than a fetched one is to the other); 2 holds unchanged (every option's price is
at least the wait, and an idle worker's price at most its recompute); 3 holds with "prefill
of its own" read as the chosen option's (``WorkerCost.prefill_s``).

:func:`choose` prices every candidate (:func:`price`) and picks: the executable specification.
:mod:`router.routing.load_groups` reaches the same choice without pricing each worker that holds
nothing of the prompt; a differential test holds the two equal.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.routing.rates import Rates

__all__ = ["UNIT_RATES", "Candidate", "Decision", "FetchSource", "Pricing", "WorkerCost",
           "choose", "copy_seconds", "cost_of", "fetch_terms", "prefill_seconds", "price", "select"]

#: One second a block of prefill, nothing else: the rates a bare :class:`Candidate` has.
UNIT_RATES = Rates(prefill_s=1.0)


def prefill_seconds(prefill_s: float, context_s: float, onboard_s: float, new: int,
                    matched: int, host: int) -> float:
    """Seconds to prefill ``new`` blocks after ``matched`` held ones, ``host`` of them to copy
    back from the host tier (module docstring). The one formula :func:`cost_of` and the fast
    path both compute, so equal inputs give the same float."""
    return prefill_s * new + context_s * new * (matched + 0.5 * new) + onboard_s * host


@dataclass(frozen=True, slots=True)
class FetchSource:
    """A worker a candidate may fetch the prompt's leading blocks from (module docstring)."""

    worker: int
    #: The leading run of the prompt's blocks it holds on its device.
    blocks: int
    #: Seconds a block takes over its link to the candidate (the copy floor applied).
    block_s: float
    #: Seconds each fetch costs besides its blocks (a request, the source's lookup).
    read_s: float = 0.0


def fetch_terms(wait_s: float, r: Rates, request_blocks: int, matched: int, host: int,
                source: FetchSource) -> tuple[float, float, float]:
    """The transfer, the prefill left and the TTFT of fetching from ``source`` for a
    candidate that holds ``matched`` blocks (``host`` of them on its host tier), waits
    ``wait_s`` and has rates ``r``; the source must hold more than ``matched``. The one
    formula the specification and the fast path compute, so equal inputs give one float."""
    held = min(source.blocks, request_blocks)
    transfer = source.read_s + (held - matched) * source.block_s
    own = prefill_seconds(r.prefill_s, r.context_s, r.onboard_s, request_blocks - held, held,
                          host)
    return transfer, own, ((wait_s + transfer) + own) + r.first_s


# Candidate and WorkerCost are built per priced worker per request on the hot path: plain
# slotted classes, since a frozen dataclass's __init__ costs an object.__setattr__ per field.
@dataclass(slots=True)
class Candidate:
    """One worker that may serve the request, with what the router knows of it."""

    worker: int
    matched_blocks: int = 0
    device_matched_blocks: int = 0
    #: Seconds of work queued before this request's prefill could start.
    wait_s: float = 0.0
    #: Its rates per block, multiplied by its learned factor.
    rates: Rates = field(default=UNIT_RATES)
    #: Blocks of prefill queued there (shown; the wait already prices them).
    pending_prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    active_requests: int = 0
    #: The later requests its prefill is priced as delaying when no candidate is idle
    #: (``n`` in the module docstring; at least 1).
    passed_on: float = 1.0
    #: The workers it may fetch the prompt's leading blocks from, in the order a tie
    #: between them goes (none: it recomputes what it lacks).
    sources: tuple[FetchSource, ...] = ()


@dataclass(slots=True, kw_only=True)
class WorkerCost:
    """The terms of one candidate's price, as ``/debug/route`` shows them."""

    worker: int
    matched_blocks: int
    device_matched_blocks: int
    #: Blocks this request would prefill there (the rest are held).
    prefill_blocks: int
    pending_prefill_blocks: float
    decode_blocks: float
    active_requests: int
    #: Seconds queued ahead of it.
    wait_s: float
    #: Seconds of its own prefill.
    prefill_s: float
    #: The predicted time to first token, in seconds.
    cost: float
    #: What the choice minimises: ``cost``, plus ``prefill_s`` times the later requests it
    #: delays in a busy fleet; ``prefill_s`` alone within a TTFT objective (module docstring).
    price: float
    #: Priced within a TTFT objective (a busy fleet, ``cost`` at most the objective).
    within_slo: bool = False
    #: The chosen option's source when it is a fetch (None: it recomputes what it lacks).
    #: ``prefill_blocks``, ``prefill_s``, ``cost`` and ``price`` are then the fetch's.
    fetch_source: int | None = None
    #: The blocks the source holds, which the instruction names (0: no fetch chosen).
    fetch_blocks: int = 0
    #: Seconds of the chosen fetch's transfer (in ``cost``, not passed on).
    fetch_s: float = 0.0
    #: The recompute option's TTFT and price (``cost`` and ``price`` when no fetch is
    #: chosen).
    recompute_cost: float = 0.0
    recompute_price: float = 0.0
    #: The cheapest fetch option's source, TTFT and price, chosen or not (None: none).
    best_source: int | None = None
    fetch_cost: float | None = None
    fetch_price: float | None = None

    @property
    def computed_after(self) -> int:
        """The blocks its prefill starts after: its own hit, or the blocks fetched to it."""
        return self.fetch_blocks if self.fetch_source is not None else self.matched_blocks

    @property
    def rank(self) -> tuple[float, float, int]:
        """What the choice orders candidates by: the price, then the TTFT if within an
        objective, then the active requests (the rest of a tie is drawn at random)."""
        return (self.price, self.cost if self.within_slo else 0.0, self.active_requests)


class Decision:
    """The chosen worker, its cost terms, and every candidate's, cheapest first.

    ``costs`` may be computed on first access (by the fast path, from the state then): a
    decision read at once, as ``/debug/route`` does, shows exactly the state it was made on.

    Args:
        worker: the chosen worker.
        costs: every candidate's terms, cheapest first; or None with ``explain``.
        chosen: the chosen worker's terms (found in ``costs`` when omitted).
        explain: computes ``costs`` when first read.

    Attributes:
        worker: the chosen worker.
        chosen: its cost terms (a plain attribute: a request reads it about ten times).
    """

    __slots__ = ("_costs", "_explain", "chosen", "worker")

    def __init__(self, worker: int, costs: tuple[WorkerCost, ...] | None = None, *,
                 chosen: WorkerCost | None = None,
                 explain: Callable[[], tuple[WorkerCost, ...]] | None = None) -> None:
        if costs is None and explain is None:
            raise ValueError("a decision needs its costs or a way to compute them")
        self.worker = worker
        self._costs = costs
        self._explain = explain
        if chosen is None:
            chosen = next(c for c in self.costs if c.worker == worker)
        self.chosen = chosen

    @property
    def costs(self) -> tuple[WorkerCost, ...]:
        """Every candidate's cost terms, cheapest first."""
        if self._costs is None:
            assert self._explain is not None
            self._costs, self._explain = self._explain(), None
        return self._costs

    def terms(self, worker: int) -> WorkerCost:
        """The cost terms of ``worker`` (the chosen one, or a fallback)."""
        if worker == self.worker:
            return self.chosen
        return next(c for c in self.costs if c.worker == worker)

    def __repr__(self) -> str:
        return f"Decision(worker={self.worker})"


def _priced(cost: float, prefill: float, busy: bool, slo: float | None, passed_on: float
            ) -> tuple[bool, float]:
    """Whether an option is within the objective, and its price (module docstring)."""
    if busy and slo is not None and cost <= slo:
        return True, prefill
    if busy:
        return False, cost + passed_on * prefill
    return False, cost


def copy_seconds(r: Rates, request_blocks: int, matched: int, source: FetchSource) -> float:
    """The prefill seconds of the blocks a fetch from ``source`` copies to a candidate that
    holds ``matched``: what the copy may cost the fleet again, in a busy fleet whose caches
    turn over, as the blocks it evicts are recomputed (module docstring)."""
    held = min(source.blocks, request_blocks)
    return prefill_seconds(r.prefill_s, r.context_s, 0.0, held - matched, matched, 0)


def cost_of(candidate: Candidate, request_blocks: int, busy: bool = False,
            slo: float | None = None, pressure: float = 0.0) -> WorkerCost:
    """Return the terms of one candidate's price for a request of ``request_blocks`` blocks,
    ``busy`` when no candidate is idle (its prefill is then priced as passed on to
    ``candidate.passed_on`` later requests too, or, with a TTFT objective ``slo`` its cost
    is within, as the prefill alone): its cheapest option, recomputing what it lacks or
    fetching it from one of its sources (``pressure``: the fleet's eviction pressure, at
    most 1, which prices a busy fleet's fetched copy as passed on in that share)."""
    matched = min(candidate.matched_blocks, request_blocks)
    device = min(candidate.device_matched_blocks, matched)
    new = request_blocks - matched
    r = candidate.rates
    host = matched - device
    prefill = prefill_seconds(r.prefill_s, r.context_s, r.onboard_s, new, matched, host)
    cost = (candidate.wait_s + prefill) + r.first_s
    within, priced = _priced(cost, prefill, busy, slo, candidate.passed_on)
    wc = WorkerCost(worker=candidate.worker, matched_blocks=matched,
                    device_matched_blocks=device, prefill_blocks=new,
                    pending_prefill_blocks=candidate.pending_prefill_blocks,
                    decode_blocks=candidate.decode_blocks,
                    active_requests=candidate.active_requests, wait_s=candidate.wait_s,
                    prefill_s=prefill, cost=cost, price=priced, within_slo=within,
                    recompute_cost=cost, recompute_price=priced)
    if candidate.sources:
        best: tuple[float, float] | None = None
        for source in candidate.sources:
            if min(source.blocks, request_blocks) <= matched:
                continue
            transfer, own, fcost = fetch_terms(candidate.wait_s, r, request_blocks, matched,
                                               host, source)
            fwithin, fprice = _priced(fcost, own, busy, slo, candidate.passed_on)
            if busy and not fwithin and pressure:
                fprice = fcost + candidate.passed_on * (own + pressure * copy_seconds(
                    r, request_blocks, matched, source))
            rank = (fprice, fcost if fwithin else 0.0)
            if best is None or rank < best:
                best = rank
                option = (source, transfer, own, fcost, fwithin, fprice)
        if best is not None:
            source, transfer, own, fcost, fwithin, fprice = option
            wc.best_source, wc.fetch_cost, wc.fetch_price = source.worker, fcost, fprice
            if best < (priced, cost if within else 0.0):
                held = min(source.blocks, request_blocks)
                wc.fetch_source, wc.fetch_blocks, wc.fetch_s = source.worker, held, transfer
                wc.prefill_blocks, wc.prefill_s = request_blocks - held, own
                wc.cost, wc.price, wc.within_slo = fcost, fprice, fwithin
    return wc


@dataclass(slots=True)
class Pricing:
    """Every candidate priced for one request (:func:`price`)."""

    #: Cost terms, least :attr:`WorkerCost.rank` first (then lower worker id).
    costs: list[WorkerCost]


def price(request_blocks: int, candidates: Sequence[Candidate], slo: float | None = None,
          pressure: float = 0.0) -> Pricing:
    """Price every candidate for a request of ``request_blocks`` full blocks (module
    docstring; arguments as :func:`choose`)."""
    if not candidates:
        raise ValueError("no candidate workers")
    if request_blocks < 0:
        raise ValueError(f"request_blocks must be >= 0, got {request_blocks}")
    busy = all(c.wait_s > 0 for c in candidates)
    costs = [cost_of(c, request_blocks, busy, slo, pressure) for c in candidates]
    costs.sort(key=lambda c: (c.rank, c.worker))
    return Pricing(costs)


def select(pricing: Pricing, rng: random.Random) -> int:
    """Pick the worker from a :class:`Pricing`: the least rank, ties at random."""
    costs = pricing.costs
    best = costs[0].rank
    tied = [c.worker for c in costs if c.rank == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def choose(request_blocks: int, candidates: Sequence[Candidate], rng: random.Random,
           slo: float | None = None, pressure: float = 0.0) -> Decision:
    """Pick the worker for a request of ``request_blocks`` full blocks.

    Args:
        request_blocks: the prompt's full blocks (the ones the index can match).
        candidates: the workers that may serve it, with matches, waits and rates.
        rng: breaks ties.
        slo: the TTFT objective in seconds (None: none; module docstring).
        pressure: the fleet's eviction pressure, in [0, 1] (a fetched copy's price).

    Returns:
        The decision, with every candidate's cost terms.

    Raises:
        ValueError: no candidates, or a negative block count.
    """
    pricing = price(request_blocks, candidates, slo, pressure)
    worker = select(pricing, rng)
    return Decision(worker, tuple(pricing.costs))
