"""The routing core: what the router knows of its workers, and the decision it makes from it.

:class:`RoutingCore` holds everything a decision reads besides the prefix index: the load books
(:mod:`router.routing.load`), predicted residency (:mod:`router.routing.residency`), live sessions
(:mod:`router.routing.sessions`) and the eviction pressure that sets the queue weight under ``auto``
(:mod:`router.routing.pressure`). :meth:`RoutingCore.decide` takes a request's block hashes, the
index's matches for them and ``now``, and returns the :class:`~router.routing.scheduler.Decision`
with every term ``/debug/route`` shows; :meth:`RoutingCore.routed` books the request where it went.
The HTTP router (:class:`router.service.RouterService`) and the benchmark's ``kvroute`` policy
(:mod:`bench.policies.kvroute_policy`) are thin shells around it.

Pure: no I/O, no clock, no event loop; the caller passes ``now`` (monotonic seconds) and the
random source. When every tracked worker is a candidate, the choice
prices only the workers holding some of the prompt one by one (:mod:`router.routing.load_groups`);
otherwise every candidate is priced (:func:`router.routing.scheduler.choose`). Both give the same
decision.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from indexer.events import Cleared, Event
from router.routing.load import LoadTracker
from router.routing.load_groups import LoadGroups, LoadKey, choose_fast
from router.routing.pressure import EvictionPressure, queue_weight_for
from router.routing.residency import PredictedResidency
from router.routing.scheduler import Candidate, Decision, SchedulerConfig, WorkerCost, choose, price
from router.routing.sessions import Continuation, SessionTracker

__all__ = ["CoreSettings", "Routed", "RoutingCore", "WorkerFacts"]

#: Match lengths per worker, as :meth:`indexer.index.PrefixIndex.match` gives them:
#: ``worker -> (blocks matched on any tier, blocks matched on the device)``.
Matches = Mapping[int, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """What the core needs to know of a worker besides its load."""

    #: The worker publishes no KV events: its residency is learned from routing alone.
    approximate: bool = False


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """The core's settings (the router's flags, read once)."""

    #: The cost rule's weights; ``queue_weight`` is the fixed one unless ``auto_queue``.
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    #: Queue weight by eviction pressure (:mod:`router.routing.pressure`) instead of the fixed one.
    auto_queue: bool = True
    #: Seconds a routed prompt's blocks count as resident before events say so.
    predict_ttl: float = 10.0
    #: Seconds a routed prompt's blocks count as resident on a worker without events.
    approximate_ttl: float = 120.0
    #: Follow sessions (continuations stay home; the session term).
    sessions: bool = True
    #: Seconds of removals the eviction pressure counts.
    pressure_window: float = 10.0


@dataclass(slots=True)
class Routed:
    """A decision and the session the request continues (consumed when it is booked)."""

    decision: Decision
    continued: Continuation | None


class RoutingCore:
    """The router's state and decision, without I/O (module docstring).

    Args:
        settings: the core's settings.
        facts: returns a worker's :class:`WorkerFacts`; read whenever the worker's load
            changes (an unknown worker: the defaults).
        capacity: returns the workers' device KV blocks together (0: unknown); read only
            while the caches may still be warming up.
    """

    def __init__(self, settings: CoreSettings,
                 facts: Callable[[int], WorkerFacts | None] = lambda w: None,
                 capacity: Callable[[], float] = lambda: 0.0) -> None:
        self.settings = settings
        config = settings.scheduler
        if settings.auto_queue:
            config = dataclasses.replace(config, queue_weight=queue_weight_for(0.0, warming=True))
        #: The scheduler settings of the last decision (the queue terms follow the pressure).
        self.config = config
        self.load = LoadTracker()
        self.predicted = PredictedResidency(settings.predict_ttl)
        self.approximate = PredictedResidency(settings.approximate_ttl, max_blocks=1 << 22)
        self.pressure = EvictionPressure(settings.pressure_window)
        self.sessions = SessionTracker() if settings.sessions else None
        self._facts_of = facts
        self._capacity = capacity
        self._facts: dict[int, WorkerFacts] = {}
        self._groups = LoadGroups()
        self.load.on_change = self._refresh
        if self.sessions is not None:
            self.sessions.on_change = self._refresh

    # -- the workers ------------------------------------------------------------------------

    def _refresh(self, worker: int) -> None:
        if self.load.tracked(worker):
            self._facts[worker] = self._facts_of(worker) or WorkerFacts()
            self._groups.update(worker, self._key(worker))
        else:
            self._facts.pop(worker, None)
            self._groups.remove(worker)

    def _key(self, worker: int) -> LoadKey:
        load = self.load.load(worker)
        live = float(self.sessions.live(worker)) if self.sessions is not None else 0.0
        return (load.pending_prefill_blocks, load.decode_blocks, load.active_requests, live)

    def workers(self) -> int:
        """How many workers are tracked."""
        return len(self._facts)

    def forget(self, worker: int, now: float, registered: bool) -> None:
        """Drop every prediction and session on ``worker`` (its cached blocks were cleared).
        A worker still ``registered`` (restarted, or unhealthy) keeps its peak as the
        pressure's capacity; a removed one leaves the pressure entirely."""
        self.predicted.forget(worker)
        self.approximate.forget(worker)
        if self.sessions is not None:
            self.sessions.forget(worker)
        if registered:
            self.pressure.observe(worker, [Cleared()], now)
        else:
            self.pressure.forget(worker)

    def observe(self, worker: int, events: Iterable[Event], now: float) -> None:
        """``worker``'s normalised KV events were applied to the index at ``now``."""
        self.pressure.observe(worker, events, now)

    # -- the decision -----------------------------------------------------------------------

    def queue_weight(self, now: float) -> float:
        """The queue weight a decision at ``now`` uses: the fixed one, or under ``auto`` the
        eviction pressure's (:func:`router.routing.pressure.queue_weight_for`)."""
        if not self.settings.auto_queue:
            return self.settings.scheduler.queue_weight
        pressure = self.pressure
        if not pressure.warmed and pressure.warming(self._capacity()):
            return queue_weight_for(0.0, warming=True)
        return queue_weight_for(pressure.pressure(now))

    def decide(self, hashes: Sequence[int], matches: Matches, now: float,
               rng: random.Random, *, workers: Sequence[int] | None = None, tokens: int = 0
               ) -> Routed:
        """Choose the worker for a request.

        Args:
            hashes: the prompt's full blocks' hashes.
            matches: the index's matches for ``hashes``.
            now: monotonic seconds.
            rng: breaks ties.
            workers: the candidates; None: every tracked worker.
            tokens: the prompt's length in tokens (a session continues only a longer one).

        Raises:
            ValueError: no candidate worker.
        """
        weight = self.queue_weight(now)
        config = self.config
        if weight != config.queue_weight:
            config = self.config = dataclasses.replace(config, queue_weight=weight)
        sessions = self.sessions
        continued = home = None
        rate = 0.0
        if sessions is not None:
            continued = sessions.continuation(hashes, now, tokens)
            rate = sessions.continue_rate
            if continued is not None:
                home = continued.worker
        blocks = len(hashes)
        if workers is not None and len(workers) == len(self._groups) and all(
                w in self._groups for w in workers):
            workers = None
        if workers is None:
            holders = self._holders(hashes, matches, now)
            fast = choose_fast(blocks, holders, self._groups, config, rng, home, rate)

            def explain() -> tuple[WorkerCost, ...]:
                candidates = self.candidates(sorted(self._facts), hashes, matches, now)
                return tuple(price(blocks, candidates, config, home, rate).costs)

            decision = Decision(fast.worker, None, fast.overlap_weight, chosen=fast.chosen,
                                explain=explain)
            return Routed(decision, continued)
        if not workers:
            raise ValueError("no candidate workers")
        candidates = self.candidates(workers, hashes, matches, now)
        return Routed(choose(blocks, candidates, config, rng, home, rate), continued)

    def candidates(self, workers: Iterable[int], hashes: Sequence[int], matches: Matches,
                   now: float) -> list[Candidate]:
        """Every one of ``workers`` as the scheduler prices it."""
        return [self._candidate(w, hashes, matches.get(w, (0, 0)), now) for w in workers]

    def _candidate(self, worker: int, hashes: Sequence[int], match: tuple[int, int],
                   now: float) -> Candidate:
        matched, device = match
        facts = self._facts.get(worker)
        approximate = facts is not None and facts.approximate
        residency = self.approximate if approximate else self.predicted
        extended = residency.extend(worker, hashes, matched, now)
        # A tracked worker's figures, as the groups keep them (every change of the books or
        # the sessions calls back); an untracked one's, from the books.
        key = self._groups.key(worker) if worker in self._facts else self._key(worker)
        return Candidate(worker, extended, device + extended - matched, key[0], key[1], key[2],
                         key[3])

    def _holders(self, hashes: Sequence[int], matches: Matches, now: float
                 ) -> list[Candidate]:
        """The tracked workers that match some of the request (index or prediction)."""
        tracked = self._facts  # holds exactly the tracked workers
        found: list[int] = []
        for w in matches:
            if w in tracked:
                found.append(w)
        if hashes:
            predicted = (self.predicted.holders(hashes[0], now)
                         + self.approximate.holders(hashes[0], now))
            if predicted:
                seen = set(found)
                for w in predicted:
                    if w not in seen and w in tracked:
                        seen.add(w)
                        found.append(w)
        candidates: list[Candidate] = []
        for w in found:
            candidates.append(self._candidate(w, hashes, matches.get(w, (0, 0)), now))
        return candidates

    # -- booking ----------------------------------------------------------------------------

    def credited(self, decision: Decision, worker: int) -> float:
        """The blocks ``decision`` credited as cached on ``worker`` (the chosen one or a
        fallback)."""
        if worker == decision.worker:
            return decision.chosen.credited_blocks
        return next(c.credited_blocks for c in decision.costs if c.worker == worker)

    def routed(self, request_id: str, worker: int, hashes: Sequence[int], credited: float,
               now: float, continued: Continuation | None = None, tokens: int = 0) -> None:
        """Book a request as sent to ``worker``: its uncached blocks as pending prefill, its
        prompt as resident there from now, and its session as living there.

        Raises:
            ValueError: the request id is in flight already, or the worker is not tracked.
        """
        blocks = len(hashes)
        self.load.routed(request_id, worker, blocks - credited, max(blocks, 1))
        facts = self._facts.get(worker) or WorkerFacts()
        residency = self.approximate if facts.approximate else self.predicted
        residency.expire(now)  # amortised: only the expired front is looked at
        residency.predict(worker, hashes, now)
        if self.sessions is not None:
            self.sessions.routed(hashes, worker, now, continued, tokens)

