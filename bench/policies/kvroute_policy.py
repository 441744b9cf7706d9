"""``kvroute``: the router's decision, made by the router's own code.

A thin shell around :class:`router.routing.core.RoutingCore`, as
:class:`router.service.RouterService` is: per request it hands the core the event-fed index's
matches and ``now``, books the choice where it went, feeds the core each worker's first tokens
(which teach its rates) and ends, and the normalised events the index applies. It keeps each
first token's predicted and delivered seconds (:meth:`KvroutePolicy.predictions`). On a cluster
with prefill and decode roles it routes as :meth:`router.service.RouterService.decide` does,
by the same code: the decode worker by the rule among the workers that are not prefill-only
(no peer fetch), then :func:`router.routing.disaggregation.choose_prefill` (no remote prefill
when the decode worker holds enough, else the prefill worker by the rule among the prefill
workers), both booked as the router books them (the decode booking at
:func:`~router.routing.disaggregation.decode_terms`, with the remote prefill's predicted time
to first token). The settings
are :class:`router.settings.RouterSettings`, so a run with ``--set NAME=VALUE``
(:mod:`bench.replay`) is the router with that flag, and a policy named
``kvroute[NAME=VALUE,...]`` (:func:`bench.policies.make_policies`) runs the router with those
settings beside the default: ``kvroute[learn_rates=off]``, or ``kvroute[policy=dynamo]`` for
Dynamo's rule through the same books, or ``kvroute[kv_fetch=off]``.

On a cluster whose workers fetch (:attr:`~bench.policies.base.ClusterView.peer_fetch`) every
worker joins as serving and receiving peer fetches, as a kvroute worker's ``/model_info``
advertises them; a decision that chose a fetch tells its worker to fetch
(:meth:`KvroutePolicy.fetch_for`), and each result teaches the pair's link or backs it off,
as the router's answer header does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from bench.policies.base import PREFILL_SUFFIX, ClusterView, Policy, RouteRequest
from indexer.events import Event
from router.routing.core import RoutingCore
from router.routing.disaggregation import choose_prefill, decode_terms
from router.routing.fetch_links import FetchAbility
from router.settings import RouterSettings

__all__ = ["KvroutePolicy"]


class KvroutePolicy(Policy):
    """The kvroute router's routing core (module docstring).

    Args:
        settings: the router's settings (its defaults when omitted); only the routing ones
            are read.
        name: the name the run reports (``kvroute`` by default).
    """

    name = "kvroute"
    needs_index = True
    disaggregates = True
    #: Tells workers to fetch where the rule chose it (a subclass that books its own
    #: decisions turns this off).
    fetches = True

    def __init__(self, settings: RouterSettings | None = None, name: str | None = None) -> None:
        self.settings = settings or RouterSettings()
        if name is not None:
            self.name = name  # type: ignore[misc]  # a per-instance name for variants

    def with_settings(self, **changes: object) -> KvroutePolicy:
        """The same policy with some settings changed (``RouterSettings`` field names)."""
        return KvroutePolicy(dataclasses.replace(self.settings, **changes),  # type: ignore[arg-type]
                             self.name)

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        core = dataclasses.replace(self.settings.core_settings(), block_size=cluster.block_size)
        self.core = RoutingCore(core)
        self._predictions: list[tuple[float, float]] = []
        ability = None
        if self.fetches and getattr(cluster, "peer_fetch", False):
            ability = FetchAbility(True, True, cluster.kv_bytes_per_token)
        for w in range(cluster.num_workers):
            self.core.worker_joined(w, capacity_blocks=float(cluster.capacity_blocks),
                                    fetch=ability)
        # As the router's fleet has it: prefill workers prefill for the others, unless there
        # are no others.
        roles = cluster.roles
        serving = [w for w, r in enumerate(roles) if r != "prefill"]
        self._prefill_workers = [w for w, r in enumerate(roles) if r == "prefill"] if serving \
            else []
        self._serving = serving if self._prefill_workers else None
        self._prefill_of: dict[str, int] = {}
        self._prefill_link = self.settings.prefill_link()
        #: Each request told to fetch: its source, blocks and worker.
        self._fetch_of: dict[str, tuple[int, int, int]] = {}
        self._fetching: dict[str, tuple[int, int]] = {}  # sent: source, worker

    def route(self, request: RouteRequest, now: float) -> int:
        hashes = request.hashes
        index = self.cluster.index
        assert index is not None, "kvroute needs the event-fed index"
        matches = index.match(hashes) if hashes else {}
        tokens = len(request.token_ids)
        rng = self.cluster.rng
        # As the router decides (router.service.RouterService.decide): the decode worker
        # (no peer fetch where prefill workers move the KV), then the remote prefill.
        routed = self.core.decide(hashes, matches, now, rng, workers=self._serving,
                                  tokens=tokens, fetch=not self._prefill_workers)
        decision = routed.decision
        terms = decision.chosen
        predicted = None
        remote = choose_prefill(self.core, hashes, matches, now, rng, terms, tokens,
                                self._prefill_workers, self._prefill_link) \
            if self._prefill_workers else None
        if remote is not None:
            prefill = remote.decision
            self.core.routed(request.request_id + PREFILL_SUFFIX, prefill.worker, hashes,
                             prefill.chosen, now)
            self._prefill_of[request.request_id] = prefill.worker
            predicted = remote.ttft_s
            terms = decode_terms(terms)
        self.core.routed(request.request_id, decision.worker, hashes, terms, now,
                         routed.continued, tokens, predicted)
        if terms.fetch_source is not None and predicted is None:
            self._fetch_of[request.request_id] = (terms.fetch_source, terms.fetch_blocks,
                                                  decision.worker)
        return decision.worker

    def fetch_for(self, request_id: str) -> tuple[int, int] | None:
        told = self._fetch_of.pop(request_id, None)
        if told is None:
            return None
        self._fetching[request_id] = (told[0], told[2])
        return told[0], told[1]

    def fetch_result(self, request_id: str, blocks: int, nbytes: int, seconds: float,
                     now: float) -> None:
        pair = self._fetching.pop(request_id, None)
        if pair is None:
            return
        self.core.fetch_answered(request_id, blocks if blocks else None)
        # A simulated fetch fails only for the caches' state (the holder lost the blocks,
        # the taker had no room: FETCH_STATE_FAILURES), which backs no link off.
        if blocks:
            self.core.fetched(pair[0], pair[1], float(nbytes), seconds)

    def prefill_for(self, request_id: str) -> int | None:
        return self._prefill_of.pop(request_id, None)

    def first_token(self, request_id: str, now: float) -> None:
        prediction = self.core.first_token(request_id, now)
        # A remote prefill's first token is the prefill worker's, not the client's: it
        # teaches that worker's rate, and is no prediction of a time to first token.
        if prediction is not None and not request_id.endswith(PREFILL_SUFFIX):
            self._predictions.append((prediction.predicted_s, prediction.delivered_s))

    def finished(self, request_id: str, now: float) -> None:
        self.core.finished(request_id)

    def predictions(self) -> list[tuple[float, float]] | None:
        """Each client's first token's predicted and delivered seconds since routing, in
        order (a remote prefill's own token not counted; None
        under a rule that prices in blocks or not at all: ``dynamo``, the baselines)."""
        return self._predictions if self.settings.rule.predicts_ttft else None

    def index_events(self, worker: int, events: Sequence[Event], now: float) -> None:
        self.core.events_applied(worker, events, now)

