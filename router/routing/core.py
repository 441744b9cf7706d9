"""The routing core: what the router knows of its workers, and the decision it makes from it.

:class:`RoutingCore` holds everything a decision reads besides the prefix index: the load books
(:mod:`router.routing.load`), each worker's rates and their learned factor
(:mod:`router.routing.rates`), predicted residency (:mod:`router.routing.residency`), live
sessions (:mod:`router.routing.sessions`, shown, not priced) and the eviction pressure
(:mod:`router.routing.pressure`, shown). :meth:`RoutingCore.decide` takes a request's block
hashes, the index's matches for them and ``now``, and returns the
:class:`~router.routing.scheduler.Decision` with every term ``/debug/route`` shows: each
candidate priced by the time to first token it would give. :meth:`RoutingCore.routed` books
the request where it went. The HTTP router (:class:`router.service.RouterService`) and the
benchmark's ``kvroute`` policy (:mod:`bench.policies.kvroute_policy`) are thin shells around it.

The core is told, never asks: every fact comes in by a method as it happens (a worker joined,
was described, left or had its cache cleared; it reported its load; its events were applied; a
request was routed, produced its first token, finished or was withdrawn), and what callers
need to know comes out by verbs (:meth:`RoutingCore.pending_prefill`, ...); its books stay
inside. A first token also teaches the worker's rate factor: the seconds it took against the
work predicted for it (:class:`~router.routing.rates.RateScale`), unless rates are set by hand.
The cache-blind baselines (``round_robin``, ``random``) are choices the core makes in place of
the rule, pricing only the worker they chose (its booking needs its hit). ``dynamo`` is NVIDIA
Dynamo's rule as fixed rates in blocks (:data:`~router.routing.rates.DYNAMO_RATES`).

Pure: no I/O, no clock, no event loop; the caller passes ``now`` (monotonic seconds) and the
random source. When every tracked worker is a candidate, the choice prices only the workers
holding some of the prompt one by one (:mod:`router.routing.load_groups`); otherwise every
candidate is priced (:func:`router.routing.scheduler.choose`). Both give the same decision.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from indexer.events import Cleared, Event
from router.routing.fetch_links import FETCH_READ_S, IPC_BANDWIDTH, FetchAbility, FetchLinks
from router.routing.load import LoadTracker, ReportedLoad
from router.routing.load_groups import LoadGroups, LoadKey, choose_fast
from router.routing.policy import BASELINES, POLICIES, Policy, policy_named
from router.routing.pressure import EvictionPressure
from router.routing.rates import DEFAULT_RATES, DYNAMO_RATES, Rates, RateScale
from router.routing.residency import Residency
from router.routing.scheduler import (
    Candidate,
    Decision,
    FetchSource,
    WorkerCost,
    choose,
    cost_of,
    prefill_seconds,
    price,
)
from router.routing.sessions import Continuation, SessionTracker

__all__ = ["BASELINES", "POLICIES", "CoreSettings", "Prediction", "Routed", "RoutingCore"]

#: Prompts whose first token came, per event-fed worker, waiting for that worker's next batch
#: of events to end their predictions (:meth:`RoutingCore.first_token`); past this many the
#: oldest keep their ttl.
MAX_SETTLING = 4096

#: Match lengths per worker, as :meth:`indexer.index.PrefixIndex.match` gives them:
#: ``worker -> (blocks matched on any tier, blocks matched on the device)``.
Matches = Mapping[int, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """The core's settings (the router's flags, read once)."""

    #: One of :data:`~router.routing.policy.POLICIES`.
    policy: str = "kv"
    #: Tokens per KV block (the rates are per token; the books are in blocks).
    block_size: int = 32
    #: Rates per token set by hand for every worker (None: each engine kind's default,
    #: :data:`router.routing.rates.DEFAULT_RATES`, and learned unless ``learn`` is off).
    rates: Rates | None = None
    #: Learn each worker's rate factor from its first tokens (never with hand-set rates).
    learn: bool = True
    #: Seconds a routed prompt's blocks count as resident before events say so.
    predict_ttl: float = 10.0
    #: Seconds a routed prompt's blocks count as resident on a worker without events.
    approximate_ttl: float = 120.0
    #: Follow sessions (shown in ``/debug/route`` and ``/metrics``; not priced).
    sessions: bool = True
    #: Seconds of removals the eviction pressure counts.
    pressure_window: float = 10.0
    #: The time to first token clients accept, in seconds (None: none stated). In a busy
    #: fleet the ``kv`` rule then takes, of the workers predicted within it, the one with the
    #: least prefill to do (:mod:`router.routing.scheduler`).
    ttft_slo: float | None = None
    #: Price peer fetches between the workers that advertise them (``docs/peer_fetch.md``;
    #: the ``kv`` rule only).
    kv_fetch: bool = True
    #: A peer fetch's link before any result: bytes a second.
    fetch_bandwidth: float = 25e9
    #: The policy ``policy`` names (set from it).
    rule: Policy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rule", policy_named(self.policy))
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.ttft_slo is not None:
            if not math.isfinite(self.ttft_slo) or self.ttft_slo <= 0:
                raise ValueError(f"ttft_slo must be a positive number of seconds, "
                                 f"got {self.ttft_slo}")
            if not self.rule.takes_slo:
                raise ValueError(f"ttft_slo applies to the kv policy, not {self.policy!r}")
        if not (math.isfinite(self.fetch_bandwidth) and self.fetch_bandwidth > 0):
            raise ValueError(f"fetch_bandwidth must be a positive number of bytes a second, "
                             f"got {self.fetch_bandwidth}")

    @property
    def learns(self) -> bool:
        """Whether rate factors are learned (a policy that learns them, on default rates)."""
        return self.learn and self.rates is None and self.rule.learns_rates

    def base_rates(self, engine: str) -> Rates:
        """The per-block rates of a worker of ``engine`` before its learned factor."""
        if self.rule.block_rates:
            return DYNAMO_RATES
        rates = self.rates or DEFAULT_RATES.get(engine, DEFAULT_RATES["kvroute"])
        return rates.per_block(self.block_size)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a first token told: the predicted time to it and the delivered one, in seconds."""

    worker: int
    predicted_s: float
    delivered_s: float


@dataclass(slots=True)
class _Booked:
    """What the core remembers of a routed request until its first token."""

    routed_at: float
    predicted_s: float
    #: The predicted seconds less ``first_s``, at the worker's unscaled rates (None: the
    #: prediction spans other workers' work, a remote prefill's, and teaches no rate).
    work_s: float | None
    #: The prompt's blocks, predicted resident where it went.
    hashes: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class _Fetch:
    """A request told to fetch, until its worker answers: where it went, and its booking
    should it compute the fetch's blocks after all (blocks, unscaled seconds, and the
    seconds a stored block is done at before attention, as the load books take them)."""

    worker: int
    recompute_blocks: int
    recompute_s: float
    recompute_lin: float


@dataclass(slots=True)
class Routed:
    """A decision and the session the request continues (consumed when it is booked)."""

    decision: Decision
    continued: Continuation | None


class RoutingCore:
    """The router's state and decision, without I/O (module docstring).

    Args:
        settings: the core's settings.
    """

    def __init__(self, settings: CoreSettings) -> None:
        self.settings = settings
        self._rule = settings.rule
        self._load = LoadTracker()
        self._predicted = Residency(settings.predict_ttl)
        self._approximate = Residency(settings.approximate_ttl, max_blocks=1 << 22)
        self._pressure = EvictionPressure(settings.pressure_window)
        self._sessions = SessionTracker() if settings.sessions else None
        #: Tracked workers: whether each publishes no events (residency from routing alone).
        self._tracked: dict[int, bool] = {}
        self._capacity: dict[int, float] = {}
        self._capacity_total = 0.0
        self._kind: dict[int, str] = {}  # each worker's engine kind
        # Per engine kind: its rates per block before the learned factor, the factor learned
        # from every worker of the kind, and the factor applied (moved on a 2% change).
        self._base: dict[str, Rates] = {}
        self._scale: dict[str, RateScale] = {}
        self._applied: dict[str, float] = {}
        self._rates: dict[int, Rates] = {}  # per worker, per block, the factor applied
        self._booked: dict[str, _Booked] = {}
        self._settling: dict[int, list[Sequence[int]]] = {}
        self._groups = LoadGroups()
        self._turns = 0
        self._default_rates = settings.base_rates("kvroute")
        # Peer fetch: what each worker advertises, the tracked ones that receive none, and
        # each pair's link.
        self._fetch: dict[int, FetchAbility] = {}
        self._no_receive: set[int] = set()
        self._on_device: dict[tuple[str, str], set[int]] = {}  # CUDA IPC peers by GPU
        self._http_links: dict[int, float] = {}  # HTTP fetch bandwidth below the default's
        self._links = FetchLinks(settings.fetch_bandwidth, settings.block_size)
        # Each request told to fetch until its answer; per worker, the blocks each answered
        # fetch stored whose events are still to come (not its prefill's), oldest first; per
        # source, the seconds of reads it serves, and each fetching request's read.
        self._fetches: dict[str, _Fetch] = {}
        self._fetching: dict[int, dict[str, int]] = {}
        self._reading: dict[int, float] = {}
        self._reads: dict[str, tuple[int, float]] = {}

    # -- facts about the workers --------------------------------------------------------------

    def worker_joined(self, worker: int, *, engine: str = "kvroute", approximate: bool = False,
                      capacity_blocks: float = 0.0, fetch: FetchAbility | None = None) -> None:
        """``worker`` may be routed to from now on (idempotent); ``engine``: its kind (sets
        its default rates); ``approximate``: it publishes no KV events; ``capacity_blocks``:
        its device KV blocks (0: unknown); ``fetch``: what it serves and receives of peer
        fetches (None: neither)."""
        self._load.add_worker(worker)
        if worker not in self._kind:
            self._kind[worker] = engine
            if engine not in self._base:
                self._base[engine] = self.settings.base_rates(engine)
                self._scale[engine] = RateScale()
                self._applied[engine] = 1.0
            self._rates[worker] = self._scaled(engine)
        self.worker_described(worker, approximate=approximate, capacity_blocks=capacity_blocks,
                              fetch=fetch)

    def worker_described(self, worker: int, *, approximate: bool, capacity_blocks: float,
                         fetch: FetchAbility | None = None) -> None:
        """What ``worker`` is changed (its model info was read again): whether it publishes
        events, its device KV blocks (0: unknown) and its peer fetch. An unknown worker is
        ignored."""
        if not self._load.tracked(worker):
            return
        self._tracked[worker] = approximate
        self._leave_device(worker)
        self._http_links.pop(worker, None)
        if fetch is None or not (fetch.serve or fetch.receive):
            self._fetch.pop(worker, None)
        else:
            self._fetch[worker] = fetch
            if fetch.device is not None:
                self._on_device.setdefault(fetch.device, set()).add(worker)
            default = self._links.bandwidth
            if fetch.http_link(default) < default:
                self._http_links[worker] = fetch.http_link(default)
        if fetch is not None and fetch.receive:
            self._no_receive.discard(worker)
        else:
            self._no_receive.add(worker)
        self._capacity_total += capacity_blocks - self._capacity.get(worker, 0.0)
        self._capacity[worker] = capacity_blocks
        self._refresh(worker)

    def worker_left(self, worker: int) -> list[str]:
        """``worker`` left the fleet: drop its load, rates, predictions, sessions and its place
        in the eviction pressure. Returns the ids of the requests it had in flight."""
        in_flight = self._load.remove_worker(worker)
        for rid in in_flight:
            self._booked.pop(rid, None)
            self._fetches.pop(rid, None)
        self._tracked.pop(worker, None)
        self._capacity_total -= self._capacity.pop(worker, 0.0)
        self._kind.pop(worker, None)
        self._rates.pop(worker, None)
        self._leave_device(worker)
        self._fetch.pop(worker, None)
        self._http_links.pop(worker, None)
        self._no_receive.discard(worker)
        self._links.forget(worker)
        self._fetching.pop(worker, None)
        self._reading.pop(worker, None)
        for rid in [r for r, (w, _) in self._reads.items() if w == worker]:
            del self._reads[rid]
        self._forget(worker)
        self._pressure.forget(worker)
        self._refresh(worker)
        return in_flight

    def _leave_device(self, worker: int) -> None:
        """``worker`` is no longer listed among the CUDA IPC peers of its GPU."""
        ability = self._fetch.get(worker)
        if ability is None or ability.device is None:
            return
        peers = self._on_device.get(ability.device)
        if peers is not None:
            peers.discard(worker)
            if not peers:
                del self._on_device[ability.device]

    def cache_cleared(self, worker: int, now: float) -> None:
        """``worker``'s cached blocks were cleared (restarted, reset, or unhealthy too long):
        drop every prediction and session on it; it keeps its peak as the pressure's
        capacity."""
        self._forget(worker)
        self._pressure.observe(worker, [Cleared()], now)

    def _forget(self, worker: int) -> None:
        self._settling.pop(worker, None)
        self._predicted.forget(worker)
        self._approximate.forget(worker)
        if self._sessions is not None:
            self._sessions.forget(worker)

    def load_reported(self, worker: int, load: ReportedLoad) -> None:
        """``worker`` reported its own load (folded into the books)."""
        self._load.reported(worker, load)
        self._refresh(worker)

    def events_applied(self, worker: int, events: Iterable[Event], now: float) -> None:
        """``worker``'s normalised KV events were applied to the index at ``now``: the
        predictions of the prompts whose first token came before end (their blocks were
        stored by then, and the index, now current, says so and will say when they go). The
        device blocks stored are the progress of the worker's head prefill
        (:mod:`router.routing.load`); Dynamo's rule queues a prefill whole until its first
        token. Blocks a fetch inserted are stored too, and are no prefill: the blocks each
        answered fetch received (:meth:`fetch_answered`) are taken off first."""
        stored = self._pressure.observe(worker, events, now)
        credits = self._fetching.get(worker)
        if stored and credits:
            for rid, credit in list(credits.items()):
                used = credit if credit < stored else stored
                stored -= used
                if used == credit:
                    del credits[rid]
                else:
                    credits[rid] = credit - used
                if not stored:
                    break
            if not credits:
                del self._fetching[worker]
        if stored and self._rule.tracks_prefill:
            self._load.stored(worker, stored)
            self._refresh(worker)
        settling = self._settling.pop(worker, None)
        if settling:
            for hashes in settling:
                self._predicted.settle(worker, hashes, now)

    def record_resident(self, worker: int, stored: int, removed: int, now: float) -> None:
        """Count blocks stored and removed on ``worker`` without their events (a benchmark
        that fills caches directly)."""
        self._pressure.record(worker, stored=stored, removed=removed, now=now)

    def _refresh(self, worker: int) -> None:
        if worker in self._tracked:
            self._groups.update(worker, self._key(worker))
        else:
            self._groups.remove(worker)

    def _key(self, worker: int) -> LoadKey:
        active, prefill, decode, prefill_s, external, prefilling = self._load.figures(worker)
        r = self._rates.get(worker, self._default_rates)
        factor = self.rate_factor(worker)
        wait = factor * prefill_s + r.prefill_s * external + r.decode_s * decode
        reading = self._reading.get(worker)
        if reading:
            wait += reading
        return (wait, r.prefill_s, r.context_s, r.first_s, active, prefill, decode, prefilling)

    def passed_on(self) -> float:
        """The later requests a busy fleet's prefill is priced as delaying on a worker with
        a request of ours prefilling: one, plus the fleet's mean count of requests prefilling
        per worker (:mod:`router.routing.scheduler`). Dynamo's rule keeps one."""
        if not self._rule.tracks_prefill or not self._tracked:
            return 1.0
        return 1.0 + self._load.prefilling() / len(self._tracked)

    # -- what the core knows, read ----------------------------------------------------------

    def workers(self) -> int:
        """How many workers are tracked."""
        return len(self._tracked)

    def pending_prefill(self, worker: int) -> float:
        """Blocks of prefill queued on ``worker`` (routed, no first token yet)."""
        return self._load.figures(worker)[1]

    def wait(self, worker: int) -> float:
        """Seconds of work queued on ``worker`` ahead of a new request, as priced now."""
        return self._key(worker)[0]

    def rates(self, worker: int) -> Rates:
        """``worker``'s rates per block, its learned factor applied."""
        return self._rates.get(worker, self._default_rates)

    def rate_factor(self, worker: int) -> float:
        """``worker``'s learned factor on its engine kind's rates (1: none learned)."""
        kind = self._kind.get(worker)
        return self._applied[kind] if kind is not None else 1.0

    def _scaled(self, kind: str) -> Rates:
        base, f = self._base[kind], self._applied[kind]
        if f == 1.0:
            return base
        return Rates(prefill_s=base.prefill_s * f, context_s=base.context_s * f,
                     decode_s=base.decode_s * f, onboard_s=base.onboard_s * f,
                     first_s=base.first_s)

    def in_flight(self, worker: int) -> int:
        """Requests this router has in flight on ``worker``."""
        return self._load.in_flight(worker)

    def last_report(self, worker: int) -> ReportedLoad | None:
        """What ``worker`` last reported of its own load, if anything."""
        return self._load.last_report(worker)

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

    def decide(self, hashes: Sequence[int], matches: Matches, now: float,
               rng: random.Random, *, workers: Sequence[int] | None = None, tokens: int = 0,
               fetch: bool = True) -> Routed:
        """Choose the worker for a request.

        Args:
            hashes: the prompt's full blocks' hashes.
            matches: the index's matches for ``hashes``.
            now: monotonic seconds.
            rng: breaks ties (and draws the ``random`` baseline's worker).
            workers: the candidates; None: every tracked worker.
            tokens: the prompt's length in tokens (a session continues only a longer one).
            fetch: whether a peer fetch may be chosen (where workers advertise it).

        Raises:
            ValueError: no candidate worker.
        """
        if self._rule.cache_blind:
            return Routed(self._baseline(hashes, matches, now, rng, workers), None)
        continued = None
        if self._sessions is not None:
            continued = self._sessions.continuation(hashes, now, tokens)
        blocks = len(hashes)
        if workers is not None and len(workers) == len(self._groups) and all(
                w in self._groups for w in workers):
            workers = None
        if workers is None:
            passed_on = self.passed_on()
            sources = self._sources(matches, None, blocks) if fetch else []
            holders = self._holders(hashes, matches, now, passed_on, sources)
            slo = self.settings.ttft_slo
            pressure = self.fetch_pressure(now) if sources else 0.0
            fast = choose_fast(blocks, holders, self._groups, rng, passed_on, slo, sources,
                               pressure)

            def explain() -> tuple[WorkerCost, ...]:
                candidates = self.candidates(sorted(self._tracked), hashes, matches, now,
                                             fetch=fetch)
                return tuple(price(blocks, candidates, slo, pressure).costs)

            return Routed(Decision(fast.worker, None, chosen=fast.chosen, explain=explain),
                          continued)
        if not workers:
            raise ValueError("no candidate workers")
        candidates = self.candidates(workers, hashes, matches, now, fetch=fetch)
        pressure = self.fetch_pressure(now) if any(c.sources for c in candidates) else 0.0
        return Routed(choose(blocks, candidates, rng, self.settings.ttft_slo, pressure),
                      continued)

    def fetch_pressure(self, now: float) -> float:
        """The eviction pressure a busy fleet's fetched copy is priced at: the share of the
        fleet's caches evicted in the pressure window, at most 1
        (:mod:`router.routing.scheduler`)."""
        return min(1.0, self._pressure.pressure(now))

    def _sources(self, matches: Matches, among: set[int] | None, blocks: int
                 ) -> list[FetchSource]:
        """The workers a peer fetch may read the prompt from, by id, at their default links:
        each tracked one (of ``among``, when given) that serves reads and holds some of the
        prompt's leading blocks on its device, by the index (a prediction is not yet a block
        to read). None under a rule other than ``kv``, with fetch off, or with no receiver."""
        if (not self._fetch or not self._rule.prices_fetch or not self.settings.kv_fetch
                or len(self._no_receive) == len(self._tracked) or not blocks):
            return []
        out = []
        for w in sorted(matches):
            ability = self._fetch.get(w)
            device = matches[w][1]
            if (ability is None or not ability.serve or device <= 0 or w not in self._tracked
                    or (among is not None and w not in among)):
                continue
            links = self._links
            out.append(FetchSource(w, min(device, blocks),
                                   links.default_block_s(ability.kv_bytes_per_token,
                                                         ability.http_link(links.bandwidth)),
                                   FETCH_READ_S))
        return out

    def _sources_for(self, worker: int, sources: Sequence[FetchSource], now: float
                     ) -> tuple[FetchSource, ...]:
        """``sources`` as ``worker`` may fetch from them: not itself, not a pair backed off,
        each at the pair's link (learned or the default), never cheaper a block than
        ``worker`` copies one back from its host tier."""
        if not sources or worker in self._no_receive or worker not in self._fetch:
            return ()
        floor = self._rates.get(worker, self._default_rates).onboard_s
        links = self._links
        out = []
        for s in sources:
            if s.worker == worker or links.backed_off(s.worker, worker, now):
                continue
            per_token = self._fetch[s.worker].kv_bytes_per_token
            block_s = max(links.block_s(s.worker, worker, per_token,
                                        self._advertised(s.worker, worker)), floor)
            out.append(s if block_s == s.block_s else FetchSource(s.worker, s.blocks, block_s,
                                                                  s.read_s))
        return tuple(out)

    def _advertised(self, source: int, receiver: int) -> float | None:
        """The bandwidth a pair with no result is priced at, when it advertises one of its
        own (CUDA IPC on one GPU, :data:`~router.routing.fetch_links.IPC_BANDWIDTH`; else
        the slower end's HTTP fetches when below the default); None: the default link."""
        a, b = self._fetch.get(source), self._fetch.get(receiver)
        if a is None or b is None:
            return None
        if a.shares_device(b):
            return IPC_BANDWIDTH
        default = self._links.bandwidth
        return min(a.http_link(default), b.http_link(default))

    def _own_links(self, sources: Sequence[FetchSource]) -> set[int]:
        """The tracked workers a group's default links would misprice for ``sources``: those
        that receive no fetches, those with a link of their own from one of them (learned,
        backed off, or advertised: CUDA IPC on its GPU, HTTP fetches slower than the source's),
        and those whose host copy is dearer
        than a source's default block."""
        if not sources:
            return set()
        own = set(self._no_receive)
        for s in sources:
            own.update(w for w in self._links.known(s.worker) if w in self._tracked)
            ability = self._fetch[s.worker]
            if ability.device is not None:
                own.update(w for w in self._on_device.get(ability.device, ())
                           if w in self._tracked)
            if self._http_links:  # receivers slower over HTTP than the source's own price
                link = ability.http_link(self._links.bandwidth)
                own.update(w for w, bandwidth in self._http_links.items()
                           if bandwidth < link and w in self._tracked)
        cheapest = min(s.block_s for s in sources)
        if any(self._scaled(kind).onboard_s > cheapest for kind in self._base):
            for w, r in self._rates.items():
                if w in self._tracked and any(r.onboard_s > s.block_s for s in sources):
                    own.add(w)
        return own

    def _baseline(self, hashes: Sequence[int], matches: Matches, now: float,
                  rng: random.Random, workers: Sequence[int] | None) -> Decision:
        """A cache-blind choice: the next worker in turn, or one at random. Only the chosen
        worker is priced (its booking needs the blocks it holds); the others' terms are
        priced if read (``/debug/route``, fallbacks)."""
        ids = sorted(self._tracked) if workers is None else list(workers)
        if not ids:
            raise ValueError("no candidate workers")
        if self._rule.in_turn:
            worker = ids[self._turns % len(ids)]
            self._turns += 1
        else:
            worker = rng.choice(ids)
        blocks = len(hashes)
        chosen = cost_of(self._candidate(worker, hashes, matches.get(worker, (0, 0)), now,
                                         1.0), blocks)  # priced idle: nothing passed on

        def explain() -> tuple[WorkerCost, ...]:
            return tuple(price(blocks, self.candidates(ids, hashes, matches, now)).costs)

        return Decision(worker, None, chosen=chosen, explain=explain)

    def candidates(self, workers: Iterable[int], hashes: Sequence[int], matches: Matches,
                   now: float, *, fetch: bool = True) -> list[Candidate]:
        """Every one of ``workers`` as the rule prices it (with its fetch sources among
        ``workers``, unless ``fetch`` is off)."""
        passed_on = self.passed_on()
        workers = list(workers)
        sources = self._sources(matches, set(workers), len(hashes)) if fetch else []
        return [self._candidate(w, hashes, matches.get(w, (0, 0)), now, passed_on, sources)
                for w in workers]

    def _candidate(self, worker: int, hashes: Sequence[int], match: tuple[int, int],
                   now: float, passed_on: float, sources: Sequence[FetchSource] = ()
                   ) -> Candidate:
        """``worker`` as the rule prices it; ``passed_on``: :meth:`passed_on`, the fleet's
        figure, which a worker with a request of ours prefilling takes; ``sources``: what
        the request's fetches may read from."""
        matched, device = match
        residency = self._approximate if self._tracked.get(worker) else self._predicted
        extended = residency.extend(worker, hashes, matched, now)
        # A tracked worker's figures, as the groups keep them (every change of its books or
        # rates regroups it); an untracked one's, from the books.
        key = self._groups.key(worker) if worker in self._tracked else self._key(worker)
        return Candidate(worker=worker, matched_blocks=extended,
                         device_matched_blocks=device + extended - matched, wait_s=key[0],
                         rates=self._rates.get(worker, self._default_rates),
                         pending_prefill_blocks=key[5], decode_blocks=key[6],
                         active_requests=key[4],
                         passed_on=passed_on if key[7] else 1.0,
                         sources=self._sources_for(worker, sources, now))

    def _holders(self, hashes: Sequence[int], matches: Matches, now: float, passed_on: float,
                 sources: Sequence[FetchSource] = ()) -> list[Candidate]:
        """The tracked workers that match some of the request (index or prediction), and
        those a fetch from ``sources`` prices otherwise than their group
        (:meth:`_own_links`)."""
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
        if sources:
            seen = set(found)
            for w in sorted(self._own_links(sources)):
                if w not in seen:
                    found.append(w)
        candidates: list[Candidate] = []
        for w in found:
            candidates.append(self._candidate(w, hashes, matches.get(w, (0, 0)), now,
                                              passed_on, sources))
        return candidates

    # -- facts about requests ---------------------------------------------------------------

    def routed(self, request_id: str, worker: int, hashes: Sequence[int], terms: WorkerCost,
               now: float, continued: Continuation | None = None, tokens: int = 0,
               predicted_s: float | None = None) -> None:
        """Book a request as sent to ``worker``, priced there as ``terms`` (the decision's,
        :meth:`~router.routing.scheduler.Decision.terms`): its prefill as queued work there,
        its prompt as resident there from now, and its session as living there.
        ``predicted_s``, when given, is its predicted time to first token instead of
        ``terms.cost`` (a remote prefill's, :func:`router.routing.disaggregation.
        remote_prefill_ttft`); its first token then teaches no rate.

        Raises:
            ValueError: the request id is in flight already, or the worker is not tracked.
        """
        blocks = len(hashes)
        factor = self.rate_factor(worker)
        r = self.rates(worker)
        fetching = terms.fetch_source is not None
        # Its prefill as its blocks are stored, at the rates it was priced at (unscaled, as
        # the booked seconds are): p blocks after ``matched`` cost prefill_s * p + context_s
        # * p * (matched + p / 2). A fetch joins the worker's queue when its answer comes.
        self._load.routed(request_id, worker, float(terms.prefill_blocks), max(blocks, 1),
                          terms.prefill_s / factor,
                          (r.prefill_s + r.context_s * terms.computed_after) / factor,
                          0.5 * r.context_s / factor, fetching=fetching)
        first = r.first_s
        if fetching:
            # Should the fetch fail, it computes the blocks itself: the recompute's booking.
            matched = terms.matched_blocks
            recompute = prefill_seconds(r.prefill_s, r.context_s, r.onboard_s, blocks - matched,
                                        matched, matched - terms.device_matched_blocks)
            self._fetches[request_id] = _Fetch(worker, blocks - matched,
                                               recompute / factor,
                                               (r.prefill_s + r.context_s * matched) / factor)
            # The source serves the read: its device copies the blocks out beside its
            # passes, for as long as the transfer, priced as work queued there until the
            # request's first token.
            source = terms.fetch_source
            if source in self._tracked and request_id not in self._reads:
                self._reads[request_id] = (source, terms.fetch_s)
                self._reading[source] = self._reading.get(source, 0.0) + terms.fetch_s
                self._refresh(source)
            # Its TTFT holds a transfer, which is no work at the worker's rates: it teaches
            # none (the link learns from the fetch's result).
            booked = _Booked(now, terms.cost if predicted_s is None else predicted_s, None,
                             hashes)
        elif predicted_s is None:
            booked = _Booked(now, terms.cost, (terms.cost - first) / factor, hashes)
        else:
            booked = _Booked(now, predicted_s, None, hashes)
        self._booked[request_id] = booked
        self._refresh(worker)
        residency = self._approximate if self._tracked.get(worker) else self._predicted
        residency.expire(now)  # amortised: only the expired front is looked at
        residency.predict(worker, hashes, now)
        if self._sessions is not None:
            self._sessions.routed(hashes, worker, now, continued, tokens)

    def first_token(self, request_id: str, now: float) -> Prediction | None:
        """The request produced its first token at ``now``: its prefill is done, its decode
        begins; the seconds it took teach its worker's rate factor. Returns the prediction
        and what was delivered (None: not in flight, or told before)."""
        self._read_done(request_id)
        worker = self._load.first_token(request_id)
        booked = self._booked.pop(request_id, None)
        if worker is None:
            return None
        if booked is None:
            self._refresh(worker)
            return None
        delivered = now - booked.routed_at
        if not self._tracked.get(worker) and booked.hashes:
            # Its prompt is computed and stored, and the worker's next events say so: from
            # then on the index knows, evictions included. A prediction living its whole ttl
            # past that would claim blocks the worker has since evicted.
            settling = self._settling.setdefault(worker, [])
            if len(settling) < MAX_SETTLING:
                settling.append(booked.hashes)
        kind = self._kind.get(worker)
        if self.settings.learns and kind is not None and booked.work_s is not None:
            self._learn(kind, booked.work_s, max(0.0, delivered - self._base[kind].first_s))
        self._refresh(worker)
        return Prediction(worker, booked.predicted_s, delivered)

    def _learn(self, kind: str, work_s: float, delivered_s: float) -> None:
        """Fold one first token into ``kind``'s factor; past a 2% move, reprice every worker
        of the kind (so the fleet is not regrouped at every first token)."""
        scale = self._scale[kind]
        if not scale.observed(work_s, delivered_s):
            return
        if abs(scale.factor / self._applied[kind] - 1.0) <= 0.02:
            return
        self._applied[kind] = scale.factor
        rates = self._scaled(kind)
        for w, k in self._kind.items():
            if k == kind:
                self._rates[w] = rates
                self._refresh(w)

    def fetch_ability(self, worker: int) -> FetchAbility | None:
        """What ``worker`` advertises of peer fetch, as the router may use it (None:
        nothing)."""
        return self._fetch.get(worker)

    def fetch_link_s(self, source: int, receiver: int) -> float:
        """Seconds a block takes from ``source`` to ``receiver`` as priced now (learned, or
        what the pair advertises, or the default), before the receiver's copy floor."""
        ability = self._fetch.get(source)
        return self._links.block_s(source, receiver, ability.kv_bytes_per_token
                                   if ability else 0, self._advertised(source, receiver))

    def fetched(self, source: int, receiver: int, nbytes: float, seconds: float) -> None:
        """A fetch from ``source`` to ``receiver`` moved ``nbytes`` in ``seconds``: the
        pair's link learns from it (:class:`~router.routing.fetch_links.FetchLinks`)."""
        if source in self._tracked and receiver in self._tracked:
            self._links.fetched(source, receiver, nbytes, seconds)

    def fetch_backed_off(self, source: int, receiver: int, now: float) -> bool:
        """Whether ``receiver`` may not fetch from ``source`` at ``now`` (a recent failure
        of their link)."""
        return self._links.backed_off(source, receiver, now)

    def fetch_failed(self, source: int, receiver: int, now: float) -> float:
        """A fetch from ``source`` to ``receiver`` failed (the receiver recomputed): the pair
        is no source for a while. Returns the seconds of the backoff (0: unknown
        workers)."""
        if source not in self._tracked or receiver not in self._tracked:
            return 0.0
        return self._links.failed(source, receiver, now)

    def fetch_answered(self, request_id: str, received: int | None) -> None:
        """The worker told to fetch for ``request_id`` began its answer: the fetch is over,
        and the request is in the worker's queue, behind those there before it (its booking
        joins the queue, :mod:`router.routing.load`). ``received``: the blocks the fetch
        stored there (0: it had them all), taken off the worker's next stores; None: it
        fetched nothing and computes them itself, so its booking becomes the recompute's.
        Idempotent; a request not told to fetch, or ended, is ignored."""
        fetch = self._fetches.pop(request_id, None)
        if fetch is None:
            return
        worker = fetch.worker
        if received:
            # Its blocks are stored now (their events come next, or came just before the
            # answer, in which case the next stores taken off make up for them).
            self._fetching.setdefault(worker, {})[request_id] = received
        rebooked = None if received is not None else (
            float(fetch.recompute_blocks), fetch.recompute_s, fetch.recompute_lin)
        self._load.queued(request_id, rebooked)
        self._refresh(worker)

    def _credit_done(self, worker: int, request_id: str) -> None:
        """``request_id``'s fetch will store no more blocks on ``worker``."""
        credits = self._fetching.get(worker)
        if credits is not None and credits.pop(request_id, None) is not None and not credits:
            del self._fetching[worker]

    def _read_done(self, request_id: str) -> None:
        """A fetching request's read is over (its first token came, or it ended): its
        source no longer serves it."""
        read = self._reads.pop(request_id, None)
        if read is None:
            return
        source, seconds = read
        left = self._reading.get(source, 0.0) - seconds
        if left > 1e-12:
            self._reading[source] = left
        else:
            self._reading.pop(source, None)
        self._refresh(source)

    def finished(self, request_id: str) -> int | None:
        """The request ended (answered, failed or cancelled): release its load. Idempotent.
        Returns its worker (None: it was not in flight)."""
        self._read_done(request_id)
        self._booked.pop(request_id, None)
        fetch = self._fetches.pop(request_id, None)
        worker = self._load.finished(request_id)
        if fetch is not None:
            self._credit_done(fetch.worker, request_id)
        if worker is not None:
            self._refresh(worker)
        return worker

    def withdrawn(self, worker: int, hashes: Sequence[int]) -> None:
        """``worker`` refused a request of ``hashes``: the blocks predicted there for it will
        not be resident."""
        residency = self._approximate if self._tracked.get(worker) else self._predicted
        residency.withdraw(worker, hashes)
