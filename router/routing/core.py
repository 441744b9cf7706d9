"""The routing core: what the router knows of its workers, and the decision it makes from it.

:class:`RoutingCore` holds everything a decision reads besides the prefix index: the load books
(:mod:`router.routing.load`), predicted residency (:mod:`router.routing.residency`), live sessions
(:mod:`router.routing.sessions`) and the eviction pressure that sets the queue weight under ``auto``
(:mod:`router.routing.pressure`). :meth:`RoutingCore.decide` takes a request's block hashes, the
index's matches for them and ``now``, and returns the :class:`~router.routing.scheduler.Decision`
with every term ``/debug/route`` shows; :meth:`RoutingCore.routed` books the request where it went.
The HTTP router (:class:`router.service.RouterService`) and the benchmark's ``kvroute`` policy
(:mod:`bench.policies.kvroute_policy`) are thin shells around it.

The core is told, never asks: every fact comes in by a method as it happens (a worker joined,
was described, left or had its cache cleared; it reported its load; its events were applied; a
request was routed, produced its first token, finished or was withdrawn), and what callers
need to know comes out by verbs (:meth:`RoutingCore.pending_prefill`, ...); its books stay
inside. The cache-blind baselines (``round_robin``, ``random``) are choices the core makes in
place of the rule, pricing only the worker they chose (its booking needs its hit).

Pure: no I/O, no clock, no event loop; the caller passes ``now`` (monotonic seconds) and the
random source. When every tracked worker is a candidate, the choice
prices only the workers holding some of the prompt one by one (:mod:`router.routing.load_groups`);
otherwise every candidate is priced (:func:`router.routing.scheduler.choose`). Both give the same
decision.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from indexer.events import Cleared, Event
from router.routing.load import LoadTracker, ReportedLoad
from router.routing.load_groups import LoadGroups, LoadKey, choose_fast
from router.routing.pressure import EvictionPressure, queue_weight_for
from router.routing.residency import PredictedResidency
from router.routing.scheduler import (
    Candidate,
    Decision,
    SchedulerConfig,
    WorkerCost,
    choose,
    cost_of,
    price,
)
from router.routing.sessions import Continuation, SessionTracker

__all__ = ["BASELINES", "CoreSettings", "Routed", "RoutingCore"]

#: Cache-blind choices, measured against: the next worker in turn, or one at random.
BASELINES = ("round_robin", "random")

#: Match lengths per worker, as :meth:`indexer.index.PrefixIndex.match` gives them:
#: ``worker -> (blocks matched on any tier, blocks matched on the device)``.
Matches = Mapping[int, tuple[int, int]]


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
    #: ``kv``: the cost rule; or a cache-blind baseline (:data:`BASELINES`).
    choice: str = "kv"

    def __post_init__(self) -> None:
        if self.choice != "kv" and self.choice not in BASELINES:
            raise ValueError(f"choice {self.choice!r} is not kv, {', '.join(BASELINES)}")


@dataclass(slots=True)
class Routed:
    """A decision and the session the request continues (consumed when it is booked)."""

    decision: Decision
    continued: Continuation | None


class RoutingCore:
    """The router's state and decision, without I/O (module docstring).

    The core is told, never asks: a shell tells it each fact as it happens (a worker joined,
    was described, left, had its cache cleared or reported its load; events were applied; a
    request was routed, produced its first token, finished or was withdrawn), with ``now``.

    Args:
        settings: the core's settings.
    """

    def __init__(self, settings: CoreSettings) -> None:
        self.settings = settings
        config = settings.scheduler
        if settings.auto_queue:
            config = dataclasses.replace(config, queue_weight=queue_weight_for(0.0, warming=True))
        #: The scheduler settings of the last decision (the queue terms follow the pressure).
        self.config = config
        self._load = LoadTracker()
        self._predicted = PredictedResidency(settings.predict_ttl)
        self._approximate = PredictedResidency(settings.approximate_ttl, max_blocks=1 << 22)
        self._pressure = EvictionPressure(settings.pressure_window)
        self._sessions = SessionTracker() if settings.sessions else None
        #: Tracked workers: whether each publishes no events (residency from routing alone).
        self._tracked: dict[int, bool] = {}
        self._capacity: dict[int, float] = {}
        self._capacity_total = 0.0
        self._groups = LoadGroups()
        self._turns = 0

    # -- facts about the workers --------------------------------------------------------------

    def worker_joined(self, worker: int, *, approximate: bool = False,
                      capacity_blocks: float = 0.0) -> None:
        """``worker`` may be routed to from now on (idempotent); ``approximate``: it publishes
        no KV events; ``capacity_blocks``: its device KV blocks (0: unknown)."""
        self._load.add_worker(worker)
        self.worker_described(worker, approximate=approximate, capacity_blocks=capacity_blocks)

    def worker_described(self, worker: int, *, approximate: bool, capacity_blocks: float
                         ) -> None:
        """What ``worker`` is changed (its model info was read again): whether it publishes
        events, and its device KV blocks (0: unknown). An unknown worker is ignored."""
        if not self._load.tracked(worker):
            return
        self._tracked[worker] = approximate
        self._capacity_total += capacity_blocks - self._capacity.get(worker, 0.0)
        self._capacity[worker] = capacity_blocks
        self._refresh(worker)

    def worker_left(self, worker: int) -> list[str]:
        """``worker`` left the fleet: drop its load, predictions, sessions and its place in
        the eviction pressure. Returns the ids of the requests it had in flight."""
        in_flight = self._load.remove_worker(worker)
        self._tracked.pop(worker, None)
        self._capacity_total -= self._capacity.pop(worker, 0.0)
        self._forget(worker)
        self._pressure.forget(worker)
        self._refresh(worker)
        self._settle()
        return in_flight

    def cache_cleared(self, worker: int, now: float) -> None:
        """``worker``'s cached blocks were cleared (restarted, reset, or unhealthy too long):
        drop every prediction and session on it; it keeps its peak as the pressure's
        capacity."""
        self._forget(worker)
        self._pressure.observe(worker, [Cleared()], now)
        self._settle()

    def _forget(self, worker: int) -> None:
        self._predicted.forget(worker)
        self._approximate.forget(worker)
        if self._sessions is not None:
            self._sessions.forget(worker)

    def load_reported(self, worker: int, load: ReportedLoad) -> None:
        """``worker`` reported its own load (folded into the books)."""
        self._load.reported(worker, load)
        self._refresh(worker)

    def events_applied(self, worker: int, events: Iterable[Event], now: float) -> None:
        """``worker``'s normalised KV events were applied to the index at ``now``."""
        self._pressure.observe(worker, events, now)

    def record_resident(self, worker: int, stored: int, removed: int, now: float) -> None:
        """Count blocks stored and removed on ``worker`` without their events (a benchmark
        that fills caches directly)."""
        self._pressure.record(worker, stored=stored, removed=removed, now=now)

    def _refresh(self, worker: int) -> None:
        if worker in self._tracked:
            self._groups.update(worker, self._key(worker))
        else:
            self._groups.remove(worker)

    def _settle(self) -> None:
        """Regroup the workers whose live sessions changed."""
        if self._sessions is not None:
            for w in self._sessions.take_changed():
                self._refresh(w)

    def _key(self, worker: int) -> LoadKey:
        load = self._load.load(worker)
        live = float(self._sessions.live(worker)) if self._sessions is not None else 0.0
        return (load.pending_prefill_blocks, load.decode_blocks, load.active_requests, live)

    # -- what the core knows, read ----------------------------------------------------------

    def workers(self) -> int:
        """How many workers are tracked."""
        return len(self._tracked)

    def pending_prefill(self, worker: int) -> float:
        """Blocks of prefill queued on ``worker`` (routed, no first token yet)."""
        return self._load.load(worker).pending_prefill_blocks

    def in_flight(self, worker: int) -> int:
        """Requests this router has in flight on ``worker``."""
        return self._load.in_flight(worker)

    def eviction_pressure(self, now: float) -> float:
        """Device blocks evicted in the pressure window over the fleet's peak resident."""
        return self._pressure.pressure(now)

    @property
    def follows_sessions(self) -> bool:
        """Whether sessions are followed (``CoreSettings.sessions``)."""
        return self._sessions is not None

    def live_sessions(self, worker: int) -> int:
        """Live sessions homed on ``worker`` (0 when sessions are not followed)."""
        return 0 if self._sessions is None else self._sessions.live(worker)

    @property
    def continue_rate(self) -> float:
        """The share of sessions a next turn continued (0 when not followed)."""
        return 0.0 if self._sessions is None else self._sessions.continue_rate

    def longest_held(self, hashes: Sequence[int], matches: Matches, now: float) -> int:
        """The longest leading run of ``hashes`` some worker holds, by the index's
        ``matches`` or by the predictions a decision would extend them with."""
        best = max((run for run, _ in matches.values()), default=0)
        if best == len(hashes) or not hashes:
            return best
        for residency in (self._predicted, self._approximate):
            for w in {*matches, *residency.holders(hashes[0], now)}:
                best = max(best, residency.extend(w, hashes, matches.get(w, (0, 0))[0], now))
        return best

    def predicted_blocks(self, worker: int) -> int:
        """Blocks predicted resident on ``worker`` without an event saying so yet."""
        residency = self._approximate if self._tracked.get(worker) else self._predicted
        return residency.size(worker)

    # -- the decision -----------------------------------------------------------------------

    def queue_weight(self, now: float) -> float:
        """The queue weight a decision at ``now`` uses: the fixed one, or under ``auto`` the
        eviction pressure's (:func:`router.routing.pressure.queue_weight_for`)."""
        if not self.settings.auto_queue:
            return self.settings.scheduler.queue_weight
        pressure = self._pressure
        if not pressure.warmed and pressure.warming(self._capacity_total):
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
            rng: breaks ties (and draws the ``random`` baseline's worker).
            workers: the candidates; None: every tracked worker.
            tokens: the prompt's length in tokens (a session continues only a longer one).

        Raises:
            ValueError: no candidate worker.
        """
        weight = self.queue_weight(now)
        config = self.config
        if weight != config.queue_weight:
            config = self.config = dataclasses.replace(config, queue_weight=weight)
        if self.settings.choice != "kv":
            return Routed(self._baseline(hashes, matches, now, rng, workers), None)
        sessions = self._sessions
        continued = home = None
        rate = 0.0
        if sessions is not None:
            continued = sessions.continuation(hashes, now, tokens)
            self._settle()  # expired heads
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
                candidates = self.candidates(sorted(self._tracked), hashes, matches, now)
                return tuple(price(blocks, candidates, config, home, rate).costs)

            decision = Decision(fast.worker, None, fast.overlap_weight, chosen=fast.chosen,
                                explain=explain)
            return Routed(decision, continued)
        if not workers:
            raise ValueError("no candidate workers")
        candidates = self.candidates(workers, hashes, matches, now)
        return Routed(choose(blocks, candidates, config, rng, home, rate), continued)

    def _baseline(self, hashes: Sequence[int], matches: Matches, now: float,
                  rng: random.Random, workers: Sequence[int] | None) -> Decision:
        """A cache-blind choice: the next worker in turn, or one at random. Only the chosen
        worker is priced (its booking needs the blocks it holds); the others' terms are
        priced if read (``/debug/route``, fallbacks)."""
        ids = sorted(self._tracked) if workers is None else list(workers)
        if not ids:
            raise ValueError("no candidate workers")
        if self.settings.choice == "round_robin":
            worker = ids[self._turns % len(ids)]
            self._turns += 1
        else:
            worker = rng.choice(ids)
        config = self.config
        blocks = len(hashes)
        chosen = cost_of(self._candidate(worker, hashes, matches.get(worker, (0, 0)), now),
                         blocks, config)

        def explain() -> tuple[WorkerCost, ...]:
            return tuple(price(blocks, self.candidates(ids, hashes, matches, now), config).costs)

        return Decision(worker, None, config.overlap_weight, chosen=chosen, explain=explain)

    def candidates(self, workers: Iterable[int], hashes: Sequence[int], matches: Matches,
                   now: float) -> list[Candidate]:
        """Every one of ``workers`` as the scheduler prices it."""
        return [self._candidate(w, hashes, matches.get(w, (0, 0)), now) for w in workers]

    def _candidate(self, worker: int, hashes: Sequence[int], match: tuple[int, int],
                   now: float) -> Candidate:
        matched, device = match
        residency = self._approximate if self._tracked.get(worker) else self._predicted
        extended = residency.extend(worker, hashes, matched, now)
        # A tracked worker's figures, as the groups keep them (every change of the books or
        # the sessions regroups it); an untracked one's, from the books.
        key = self._groups.key(worker) if worker in self._tracked else self._key(worker)
        return Candidate(worker=worker, matched_blocks=extended,
                         device_matched_blocks=device + extended - matched,
                         pending_prefill_blocks=key[0], decode_blocks=key[1],
                         active_requests=key[2], sessions=key[3])

    def _holders(self, hashes: Sequence[int], matches: Matches, now: float
                 ) -> list[Candidate]:
        """The tracked workers that match some of the request (index or prediction)."""
        tracked = self._tracked
        found: list[int] = []
        for w in matches:
            if w in tracked:
                found.append(w)
        if hashes:
            predicted = (self._predicted.holders(hashes[0], now)
                         + self._approximate.holders(hashes[0], now))
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

    # -- facts about requests ---------------------------------------------------------------

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
        self._load.routed(request_id, worker, blocks - credited, max(blocks, 1))
        self._refresh(worker)
        residency = self._approximate if self._tracked.get(worker) else self._predicted
        residency.expire(now)  # amortised: only the expired front is looked at
        residency.predict(worker, hashes, now)
        if self._sessions is not None:
            self._sessions.routed(hashes, worker, now, continued, tokens)
            self._settle()

    def first_token(self, request_id: str) -> None:
        """The request produced its first token: its prefill is done, its decode begins."""
        worker = self._load.first_token(request_id)
        if worker is not None:
            self._refresh(worker)

    def finished(self, request_id: str) -> None:
        """The request ended (answered, failed or cancelled): release its load. Idempotent."""
        worker = self._load.finished(request_id)
        if worker is not None:
            self._refresh(worker)

    def withdrawn(self, worker: int, hashes: Sequence[int]) -> None:
        """``worker`` refused a request of ``hashes``: the blocks predicted there for it will
        not be resident."""
        residency = self._approximate if self._tracked.get(worker) else self._predicted
        residency.withdraw(worker, hashes)
