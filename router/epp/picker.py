"""The endpoint picker's one seam onto the router: decide, admit, book, release.

Everything the EPP needs from :class:`~router.service.RouterService` goes through
:class:`Picker`: the same :meth:`~router.service.RouterService.decide` the HTTP router calls,
the same flow control (:class:`~router.http.flow.FlowControl`: while the fleet is saturated
a request is held, its ext_proc stream left unanswered, and decided again when it leaves the
queue; a refusal is a 429 with ``Retry-After``), the same booking (load, predicted residency,
session) when the request is handed to Envoy, and the same release when it ends. A request's
priority may come from the ``InferenceObjective`` the gateway names
(``x-gateway-inference-objective``, mapped by ``--objective-priorities``) and its tenant from
``x-gateway-inference-fairness-id``. Nothing here scores a worker; a change to the routing
core shows up in the EPP with no change in this package beyond this module.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from openai_request.bodies import ApiError
from router.fleet.entry import Target
from router.http.client_fields import refuse_transfer_fields
from router.http.flow import Ask, FlowControl, ask_of, tenant_of
from router.http.flow_metrics import register_flow_metrics
from router.http.metrics import RouterMetrics
from router.service import Route, RouterService

__all__ = ["ENDPOINT", "Held", "Pick", "Picker", "endpoint_of"]

#: The endpoint label of the EPP's decisions in ``kvroute_requests`` (status 200: routed).
ENDPOINT = "ext_proc"


@functools.lru_cache(maxsize=4096)
def endpoint_of(url: str) -> str:
    """A worker's base URL as the ``host:port`` Envoy's original-destination cluster dials.

    Raises:
        ValueError: the URL names no port and no http(s) scheme to imply one.
    """
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    if not parts.hostname or port is None:
        raise ValueError(f"worker URL {url!r} names no host and port")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


@dataclass(slots=True)
class Pick:
    """One request handed to Envoy: where it goes and what was booked for it.

    ``prefiller``: disaggregated serving, the prefill worker's ``host:port`` (the
    ``x-prefiller-host-port`` header; the decode pod's routing sidecar runs the prefill
    there), with ``prefill_booking`` its booking, held until the decode worker's first byte
    (the prefill is done by then) or the request's end."""

    route: Route
    worker: Target
    endpoint: str
    ended: bool = False
    prefiller: str | None = None
    prefill_booking: str | None = None


@dataclass(frozen=True, slots=True)
class Held:
    """A request flow control must hold: what deciding it again (its route carries its
    request) and booking it need."""

    route: Route
    subset: frozenset[str] | None
    ask: Ask
    tenant: str


class Picker:
    """Chooses a worker for a request body and keeps the router's books for it.

    Args:
        service: the router's state, built exactly as the HTTP router builds it.
        metrics: where decisions and answers are counted (the HTTP router's metrics, under
            the endpoint name ``ext_proc``); a fresh set when not given.
    """

    def __init__(self, service: RouterService, metrics: RouterMetrics | None = None) -> None:
        self.service = service
        self.metrics = metrics if metrics is not None else RouterMetrics(service)
        self.flow = FlowControl(service.settings.flow_settings(), service.decide_again)
        service.capacity = self.flow
        self._objectives = service.settings.objectives()
        register_flow_metrics(self.metrics.registry, self.flow, self.metrics.worker_label)

    def ready(self) -> bool:
        """Whether any worker may take a request now."""
        return bool(self.service.candidates())

    def pick(self, body: Any, kind: str, subset: frozenset[str] | None = None,
             headers: Mapping[str, str] | None = None) -> Pick | Held:
        """Decide where ``body`` goes and book it there, or say that it must wait.

        Args:
            body: the parsed request body.
            kind: ``"completions"`` or ``"chat"``.
            subset: ``host:port`` endpoints the data plane allows (the GIE subset hint);
                ``None`` allows every worker. The router's choice is kept when allowed, else
                its best-ranked allowed alternative.
            headers: the request's headers (lower-case names): its priority, tenant and
                deadline for flow control.

        Returns:
            The booked pick; or, while the fleet is saturated, a :class:`Held` for
            :meth:`admit` (nothing booked, nothing queued yet).

        Raises:
            ApiError: the body is invalid or sets a field the router sets
                (:mod:`router.http.client_fields`) (400), names an unknown model (404), cannot meet
                its deadline (429), or no (allowed) worker can take it (503).
        """
        headers = headers or {}
        try:
            if not self.service.settings.allow_client_transfer_fields:
                refuse_transfer_fields(body)
            ask = ask_of(body, headers, self._objectives)
            # The gateway forwards: no fetch instruction can go with the pick.
            route = self.service.decide(body, kind, fetch=False)
            now = self.flow.admit_now(route, ask, lambda: tenant_of(body, headers))
        except ApiError as exc:
            self.metrics.request(ENDPOINT, exc.status)
            raise
        if now is None:
            return Held(route, subset, ask, tenant_of(body, headers))
        return self._book(now, subset)

    async def admit(self, held: Held) -> Pick:
        """Wait in flow control's queue until the fleet has room, then book the request as
        decided again then.

        Raises:
            ApiError: 429 (its deadline cannot be met, the queue is full, it waited too long,
                a more urgent request displaced it) or 503 (no worker is healthy).
        """
        try:
            route = await self.flow.admit(held.route, held.ask, lambda: held.tenant)
        except ApiError as exc:
            self.metrics.request(ENDPOINT, exc.status)
            raise
        return self._book(route, held.subset)

    def _book(self, route: Route, subset: frozenset[str] | None) -> Pick:
        for worker in route.ranked():
            endpoint = endpoint_of(worker.url)
            if subset is None or endpoint in subset:
                pick = Pick(route, worker, endpoint)
                if route.prefill is not None:
                    pick.prefiller = endpoint_of(route.prefill.url)
                    pick.prefill_booking = self.service.prefill_dispatched(route)
                    counters = self.service.counters
                    counters["pd_remote_prefills"] = counters.get("pd_remote_prefills", 0) + 1
                self.service.dispatched(route, worker)
                self.metrics.decided(route)
                self.metrics.request(ENDPOINT, 200)
                return pick
        self.metrics.request(ENDPOINT, 503)
        raise ApiError(503, "no worker in the gateway's endpoint subset is available",
                       "service_unavailable")

    def pick_early(self, partial: Any, padded: Any, kind: str,
                   subset: frozenset[str] | None = None,
                   headers: Mapping[str, str] | None = None) -> Pick | None:
        """Decide on the first part of a body, when that part settles the match.

        ``partial`` is the body as far as it has arrived (its prompt cut where the bytes end);
        ``padded`` is the same with the prompt lengthened by as many characters as the body
        has bytes still to come, so the load booked counts the whole prompt. A first
        decision on ``partial``, with the router's random state put back after it, says
        whether the match ends inside what arrived: only then (its prompt was walked only
        part way, ``estimated_tokens``) can no later byte change it, and ``padded`` is decided
        and booked as :meth:`pick` does. ``None``: not settled yet (or ``partial`` is not a
        body the router takes yet), or flow control would hold it (it is held when the whole
        body has come); wait for more.

        Raises:
            ApiError: as :meth:`pick`, for a settled body.
        """
        if not self.service.settles(partial, kind):
            return None
        picked = self.pick(padded, kind, subset, headers)
        return picked if isinstance(picked, Pick) else None

    def pick_any(self, subset: frozenset[str] | None = None) -> str:
        """A worker for a request with no body to route by (``GET /v1/models``): the allowed
        healthy worker with the fewest requests in flight, as ``host:port``; nothing booked.

        Raises:
            ApiError: no (allowed) worker is healthy (503).
        """
        allowed = [(self.service.in_flight(e), e.id, endpoint_of(e.url))
                   for e in self.service.candidates()]
        allowed = [a for a in allowed if subset is None or a[2] in subset]
        if not allowed:
            raise ApiError(503, "no worker is available: "
                           f"{self.service.unavailable()}",
                           "service_unavailable")
        return min(allowed)[2]

    def first_byte(self, pick: Pick) -> None:
        """The worker started answering: its prefill (remote or its own) is done."""
        self._prefill_done(pick)
        self.service.first_token(pick.route)

    def release(self, pick: Pick) -> None:
        """The request ended (answered, failed or abandoned); idempotent."""
        if not pick.ended:
            pick.ended = True
            self._prefill_done(pick)
            self.service.finished(pick.route)

    def _prefill_done(self, pick: Pick) -> None:
        if pick.prefill_booking is not None:
            self.service.core.finished(pick.prefill_booking)
            pick.prefill_booking = None
