"""``kvroute_fixed``: our router's decision with a fixed queue weight (``--queue-weight 0.5``),
exactly as :class:`router.service.RouterService` makes it. The router's default, ``kvroute``,
is this plus the eviction-pressure queue weight (:mod:`bench.policies.kvroute_pressure`).

Per request: the index's leading match per worker, extended by predicted residency
(:class:`router.residency.PredictedResidency`: blocks of requests just routed there count as
resident for ``predict_ttl`` seconds, until the worker's events confirm them), the load books
(:class:`router.load.LoadTracker`), and :func:`router.scheduler.choose`. After the choice the
request is booked (uncached blocks as pending prefill, prompt blocks as decode after the first
token) and its blocks predicted resident on the chosen worker.

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
from router.settings import RouterSettings

#: The settings before tuning: Dynamo's weights, predictions live 2 s.
UNTUNED = {"config": SchedulerConfig(overlap_weight=1.0, queue_weight=1.0), "predict_ttl": 2.0}


class KvroutePolicy(Policy):
    """The kvroute router's scheduler, predicted residency and load books (module docstring).

    Args:
        config: scheduler settings (the router's defaults when omitted).
        predict_ttl: seconds a routed prompt's blocks count as resident before events say so
            (the router's default when omitted).
    """

    name = "kvroute_fixed"
    needs_index = True

    def __init__(self, config: SchedulerConfig | None = None,
                 predict_ttl: float | None = None) -> None:
        self.config = config or RouterSettings().scheduler_config()
        self.predict_ttl = RouterSettings().predict_ttl if predict_ttl is None else predict_ttl

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        self._load = LoadTracker()
        for w in range(cluster.num_workers):
            self._load.add_worker(w)
        self._predicted = PredictedResidency(self.predict_ttl)

    def candidates(self, hashes: list[int], now: float) -> list[Candidate]:
        """Return every worker as the router's ``_candidates`` builds it."""
        index = self.cluster.index
        assert index is not None, "kvroute needs the event-fed index"
        matches = index.match(hashes) if hashes else {}
        out = []
        for w in range(self.cluster.num_workers):
            matched, device = matches.get(w, (0, 0))
            extended = self._predicted.extend(w, hashes, matched, now)
            device += extended - matched
            load = self._load.load(w)
            if self.config.admission_weight > 0:  # as the router fills them
                out.append(Candidate(
                    w, extended, device, load.pending_prefill_blocks, load.decode_blocks,
                    load.active_requests,
                    kv_held_blocks=load.decode_blocks + self._load.waiting_blocks(w),
                    max_running=self.cluster.max_num_seqs))
            else:
                out.append(Candidate(w, extended, device, load.pending_prefill_blocks,
                                     load.decode_blocks, load.active_requests))
        return out

    def route(self, request: RouteRequest, now: float) -> int:
        hashes = request.hashes
        decision = choose(len(hashes), self.candidates(hashes, now), self.config,
                          self.cluster.rng)
        chosen = decision.chosen
        blocks = len(hashes)
        self._load.routed(request.request_id, decision.worker, blocks - chosen.credited_blocks,
                          max(blocks, 1))
        self._predicted.predict(decision.worker, hashes, now)
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
