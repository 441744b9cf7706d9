"""``kvroute_fixed``: our router's decision with a fixed queue weight (``--queue-weight 0.5``),
exactly as :class:`router.service.RouterService` makes it. The router's default, ``kvroute``,
is this plus the eviction-pressure queue weight (:mod:`bench.policies.kvroute_pressure`).

Per request: the index's leading match per worker, extended by predicted residency
(:class:`router.residency.PredictedResidency`: blocks of requests just routed there count as
resident for ``predict_ttl`` seconds, until the worker's events confirm them), the load books
(:class:`router.load.LoadTracker`), and :func:`router.scheduler.choose`. After the choice the
request is booked (uncached blocks as pending prefill, prompt blocks as decode after the first
token) and its blocks predicted resident on the chosen worker. Sessions as the router keeps
them (:class:`router.sessions.SessionTracker`): a request continuing a session stays on its
worker unless that worker's queue runs ``session_queue_blocks`` past the shortest, and the
others pay for the sessions each worker already holds (``SchedulerConfig.session_weight``; 0
leaves sessions out, as in ``kvroute_untuned`` and ``kvroute_nosessions``).

The benchmark runs it twice: ``kvroute_fixed`` with the router's other defaults (overlap
weight 32, predictions live 10 s, the admission term: tuned on this benchmark, see
``docs/benchmarks.md``; queue weight 0.5, the default before ``auto``) and
``kvroute_untuned`` with the settings before tuning (Dynamo's weights 1 and 1, predictions
live 2 s), so what the tuning bought stays visible. ``queue_weight`` scales the
pending-prefill term against the request's own uncached blocks
(``cost = overlap_weight * (uncached + queue_weight * pending_prefill) + decode``): below 1 it
prefers waiting behind a worker's queue to recomputing a prefix elsewhere; a recompute costs
the whole cluster work (and duplicates the prefix, evicting something else), a wait costs only
this request.
"""

from __future__ import annotations

from bench.policies.base import ClusterView, Policy, RouteRequest
from router.load import LoadTracker
from router.residency import PredictedResidency
from router.scheduler import Candidate, SchedulerConfig, choose
from router.sessions import SessionTracker
from router.settings import RouterSettings

#: The settings before tuning: Dynamo's weights, predictions live 2 s.
UNTUNED = {"config": SchedulerConfig(overlap_weight=1.0, queue_weight=1.0), "predict_ttl": 2.0}


class KvroutePolicy(Policy):
    """The kvroute router's scheduler, predicted residency and load books (module docstring).

    Args:
        config: scheduler settings (the router's defaults when omitted).
        predict_ttl: seconds a routed prompt's blocks count as resident before events say so
            (the router's default when omitted).
        sessions: track sessions (continuations stay home, the session term); by default
            when ``config.session_weight`` is above 0, as in the router's defaults.
    """

    name = "kvroute_fixed"
    needs_index = True

    def __init__(self, config: SchedulerConfig | None = None,
                 predict_ttl: float | None = None, sessions: bool | None = None) -> None:
        self.config = config or RouterSettings().scheduler_config()
        self.predict_ttl = RouterSettings().predict_ttl if predict_ttl is None else predict_ttl
        self.sessions = self.config.session_weight > 0 if sessions is None else sessions

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        self._load = LoadTracker()
        for w in range(cluster.num_workers):
            self._load.add_worker(w)
        self._predicted = PredictedResidency(self.predict_ttl)
        self._sessions = SessionTracker() if self.sessions else None

    def candidates(self, hashes: list[int], now: float) -> list[Candidate]:
        """Return every worker as the router's ``_candidates`` builds it."""
        index = self.cluster.index
        assert index is not None, "kvroute needs the event-fed index"
        matches = index.match(hashes) if hashes else {}
        sessions = self._sessions
        out = []
        for w in range(self.cluster.num_workers):
            matched, device = matches.get(w, (0, 0))
            extended = self._predicted.extend(w, hashes, matched, now)
            device += extended - matched
            load = self._load.load(w)
            live = sessions.live(w) if sessions is not None else 0
            if self.config.admission_weight > 0:  # as the router fills them
                out.append(Candidate(
                    w, extended, device, load.pending_prefill_blocks, load.decode_blocks,
                    load.active_requests,
                    kv_held_blocks=load.decode_blocks + self._load.waiting_blocks(w),
                    max_running=self.cluster.max_num_seqs, sessions=live))
            else:
                out.append(Candidate(w, extended, device, load.pending_prefill_blocks,
                                     load.decode_blocks, load.active_requests, sessions=live))
        return out

    def route(self, request: RouteRequest, now: float) -> int:
        hashes = request.hashes
        sessions = self._sessions
        tokens = len(request.token_ids)
        continued = sessions.continuation(hashes, now, tokens) if sessions is not None else None
        decision = choose(len(hashes), self.candidates(hashes, now), self.config,
                          self.cluster.rng, home=continued.worker if continued else None,
                          continue_rate=sessions.continue_rate if sessions is not None else 0.0)
        chosen = decision.chosen
        blocks = len(hashes)
        self._load.routed(request.request_id, decision.worker, blocks - chosen.credited_blocks,
                          max(blocks, 1))
        self._predicted.predict(decision.worker, hashes, now)
        if sessions is not None:
            sessions.routed(hashes, decision.worker, now, continued, tokens)
        return decision.worker

    def first_token(self, request_id: str, now: float) -> None:
        self._load.first_token(request_id)

    def finished(self, request_id: str, now: float) -> None:
        self._load.finished(request_id)


class KvrouteUntuned(KvroutePolicy):
    """The same policy with the settings before tuning (:data:`UNTUNED`)."""

    name = "kvroute_untuned"

    def __init__(self) -> None:
        super().__init__(**UNTUNED)  # type: ignore[arg-type]
