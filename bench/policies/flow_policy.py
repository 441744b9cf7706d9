"""``kvroute+flow``: the router's decision behind the router's flow control, in simulation.

The routing core as :class:`~bench.policies.kvroute_policy.KvroutePolicy` runs it, with
:mod:`router.routing.admission` in front: a request that finds every worker saturated (the
work queued there holding a first token past the bound, or its KV usage over the threshold) or
others already waiting is held (:data:`~bench.policies.base.HELD`) or refused
(:data:`~bench.policies.base.SHED`); the simulation asks :meth:`FlowPolicy.dispatch` after
every iteration and arrival which held requests leave now (each decided again then: late
binding) and which were shed while waiting, leaving room for the urgent as the router does
(:func:`~router.routing.admission.has_room`; ``keep_room=False``: every band leaves when the
queued work is within the bound, the rule before that, for comparison). Priorities and
tenants come from ``tags`` (request id -> (priority, tenant)); the flow settings from the
router's.
"""

from __future__ import annotations

from collections.abc import Mapping

from bench.policies.base import HELD, SHED, RouteRequest
from bench.policies.kvroute_policy import KvroutePolicy
from router.routing.admission import FlowQueue, Waiting, has_room, worker_saturated
from router.routing.scheduler import Decision, WorkerCost
from router.settings import RouterSettings

__all__ = ["FlowPolicy"]


class FlowPolicy(KvroutePolicy):
    """The kvroute policy behind flow control (module docstring).

    Args:
        settings: the router's settings (flow control's among them).
        tags: each request's priority and tenant (priority 0, tenant ``""`` when absent).
        name: the name the run reports.
        keep_room: whether the least urgent band leaves room for the urgent (module
            docstring).
    """

    name = "kvroute+flow"
    #: Its decisions are booked as they leave its queue, priced again: it tells no worker
    #: to fetch (its workers join as stock engines do).
    fetches = False

    def __init__(self, settings: RouterSettings | None = None,
                 tags: Mapping[str, tuple[int, str]] | None = None,
                 name: str | None = None, keep_room: bool = True) -> None:
        super().__init__(settings, name)
        self.flow = self.settings.flow_settings()
        self.keep_room = keep_room
        self.tags = dict(tags or {})
        self.queue = FlowQueue(self.flow)
        self._held: dict[str, RouteRequest] = {}
        #: Requests refused, by reason.
        self.shed: dict[str, int] = {}
        #: Requests that waited, and how long each did.
        self.waits: dict[str, float] = {}
        self._dropped: list[str] = []

    def _decide(self, request: RouteRequest, now: float) -> Decision:
        hashes = request.hashes
        index = self.cluster.index
        assert index is not None, "kvroute needs the event-fed index"
        matches = index.match(hashes) if hashes else {}
        return self.core.decide(hashes, matches, now, self.cluster.rng,
                                tokens=len(request.token_ids)).decision

    def _room(self, decision: Decision) -> int | None:
        """The cheapest candidate not saturated (None: the fleet is); the chosen one first.
        KV usage is the engine's own figure, as a worker's metrics report it."""
        def free(c: WorkerCost) -> bool:
            usage = self.cluster.worker_metrics(c.worker).kv_usage
            return not worker_saturated(c.cost - c.prefill_s, usage, self.flow)

        if free(decision.chosen):
            return decision.worker
        return next((c.worker for c in decision.costs if free(c)), None)

    def _leaving(self, decision: Decision, head: Waiting) -> int | None:
        """The cheapest candidate ``head`` may leave the queue for (None: none has room)."""
        keep = self.keep_room and self.queue.least_urgent(head)

        def room(c: WorkerCost) -> bool:
            usage = self.cluster.worker_metrics(c.worker).kv_usage
            first = c.cost - c.wait_s - c.prefill_s
            return has_room(c.cost - c.prefill_s, c.prefill_s, first,
                            c.pending_prefill_blocks > 0, usage, self.flow, keep_room=keep)

        if room(decision.chosen):
            return decision.worker
        return next((c.worker for c in decision.costs if room(c)), None)

    def _book(self, request: RouteRequest, decision: Decision, worker: int, now: float) -> int:
        self.core.routed(request.request_id, worker, request.hashes, decision.terms(worker),
                         now, None, len(request.token_ids))
        return worker

    def _drain(self, decision: Decision, tokens: int) -> float:
        return decision.chosen.prefill_s / max(tokens, 1) / self.cluster.num_workers

    def route(self, request: RouteRequest, now: float) -> int:
        if not self.flow.enabled:
            return super().route(request, now)
        decision = self._decide(request, now)
        priority, tenant = self.tags.get(request.request_id, (0, ""))
        deadline = self.flow.deadline(priority, now, None)
        ttft = decision.chosen.cost
        if not self.queue:
            worker = self._room(decision)
            if worker is not None:
                if deadline is not None and now + ttft > deadline:
                    self.shed["deadline"] = self.shed.get("deadline", 0) + 1
                    return SHED
                return self._book(request, decision, worker, now)
        item = Waiting(request.request_id, priority, tenant, len(request.token_ids), now,
                       deadline)
        offer = self.queue.offer(item, now, ttft, self._drain(decision, len(request.token_ids)))
        for s in offer.displaced:
            self._held.pop(s.key)
            self._dropped.append(s.key)
            self.shed[s.reason] = self.shed.get(s.reason, 0) + 1
        if offer.refused is not None:
            self.shed[offer.refused.reason] = self.shed.get(offer.refused.reason, 0) + 1
            return SHED
        self._held[request.request_id] = request
        return HELD

    def dispatch(self, now: float) -> tuple[list[tuple[str, int]], list[str]]:
        """The held requests that leave now, with their workers, and those shed."""
        out: list[tuple[str, int]] = []
        dropped, self._dropped = self._dropped, []
        while self.queue:
            head = self.queue.head()
            assert head is not None
            request = self._held[head.key]
            decision = self._decide(request, now)
            for s in self.queue.expire(now, decision.chosen.cost):
                self._held.pop(s.key)
                dropped.append(s.key)
                self.shed[s.reason] = self.shed.get(s.reason, 0) + 1
            if head.key not in self.queue:
                continue
            worker = self._leaving(decision, head)
            if worker is None:
                break
            self.queue.pop()
            del self._held[head.key]
            self.waits[head.key] = now - head.arrived
            out.append((head.key, self._book(request, decision, worker, now)))
        return out, dropped
