"""Flow control's shell: holds the requests that find the fleet saturated, and sends each on
when capacity frees (:mod:`router.routing.admission` has the rules; this module has the clock
and the event loop).

:meth:`FlowControl.admit` takes a decided :class:`~router.service.Route`. On an unsaturated
fleet with nobody waiting it returns the route as it is (one comparison on the chosen worker's
queued work, and its count of requests against its limit of sequences:
:mod:`router.routing.dispatch_gate`). Otherwise the request joins the queue and its handler
waits; one dispatcher task, alive only while the queue is not empty, decides the queue's head
again whenever capacity may have freed (a request's end or first token, a worker's report or
KV events, an arrival that joins the queue; the service tells it, :meth:`FlowControl.ended`
and the rest) and every ``tick_s`` as a safety net (late binding: the worker is chosen with
the index and loads of the moment it leaves), and lets it go as soon as some candidate has
room for it (:func:`~router.routing.admission.has_room`: the least urgent band waiting leaves
the bound's room for a more urgent arrival; below its limit of sequences, less the share kept
for the urgent). Refusals are
:class:`~openai_request.bodies.ApiError` 429s carrying ``Retry-After``; no healthy worker is
the decision's own 503.

A waiting request whose client leaves leaves the queue at once, with no worker booked and no
sequence counted (:class:`Departed`): :meth:`FlowControl.admit` is given a function that
makes a future completing when the client has gone, asks it only once the request has joined
the queue (a request admitted at once asks nothing) and hangs a callback on it, so the wait
races the client's departure without a task of its own.

What a request asks of flow control (:func:`ask_of`): its priority (the
``x-kvroute-priority`` header; else the priority configured for the Gateway API Inference
Extension ``InferenceObjective`` its ``x-gateway-inference-objective`` header names; else the
body's ``priority``, an integer as vLLM takes it, lower first), its tenant (the
``x-kvroute-tenant`` header, else the gateway's ``x-gateway-inference-fairness-id``, else the
body's ``cache_salt``, else a hash of its API key), a deadline for its first token
(``x-kvroute-ttft-deadline-ms``, else its priority's configured one), and the output tokens
it asks for at most (the body's ``max_completion_tokens``, ``max_tokens`` or
``max_output_tokens``), which tell the pace the queue drains at before requests like it end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from openai_request.bodies import ApiError
from router.routing.admission import (
    FlowQueue,
    FlowSettings,
    Shed,
    Waiting,
    has_room,
    priority_label,
    worker_saturated,
)
from router.routing.dispatch_gate import (
    CompletionRate,
    QueueStay,
    SeqLimits,
    reserved,
    starts_soon,
)
from router.routing.scheduler import Decision, WorkerCost
from router.service import Route

__all__ = ["FAIRNESS_HEADER", "OBJECTIVE_HEADER", "Ask", "Departed", "FlowControl", "Refused",
           "ask_of", "tenant_of"]

#: The Gateway API Inference Extension's request headers: the ``InferenceObjective`` a request
#: serves, and the flow it shares capacity with.
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"

#: Seconds between checks of every waiting request's wait at the measured pace (a sort of
#: the queue each).
_RECHECK_S = 0.1
#: Workers whose last seen saturation is kept at most (for ``/metrics``).
_MAX_SHOWN = 4096
#: What the shed answer's ``code`` says, per reason.
_CODES = {"deadline": "deadline_unmeetable", "queue_full": "queue_full",
          "timeout": "queue_timeout", "displaced": "queue_full"}


class Refused(ApiError):
    """A 429 from flow control: the reason and the ``Retry-After`` seconds."""

    def __init__(self, shed: Shed) -> None:
        super().__init__(429, shed.message, "rate_limit_exceeded", None, _CODES[shed.reason])
        self.reason = shed.reason
        self.retry_after_s = shed.retry_after_s
        self.headers = {"retry-after": str(shed.retry_after_s)}


class Departed(Exception):
    """The client of a waiting request left: the request left the queue with nothing booked.

    Attributes:
        waited_s: seconds it waited in the queue.
        failure: what the departure future failed with, when it was a body still arriving
            that failed while the request waited (a :class:`~httpapi.body.ClientGone`, a 413,
            a 408); None: the client left.
    """

    def __init__(self, waited_s: float, failure: BaseException | None) -> None:
        super().__init__(f"the client left after {waited_s:.3g} s in flow control's queue")
        self.waited_s = waited_s
        self.failure = failure


@dataclass(frozen=True, slots=True)
class Ask:
    """What one request asks of flow control."""

    priority: int = 0
    #: Seconds from arrival its first token is due by (None: its priority's, if any).
    deadline_s: float | None = None
    #: The output tokens it asks for at most (0: it names no limit): how long it will hold
    #: its sequence, for the pace the queue drains at (:class:`CompletionRate`).
    output_tokens: int = 0


def ask_of(body: Mapping[str, Any], headers: Mapping[str, str],
           objectives: Mapping[str, int] | None = None) -> Ask:
    """Read a request's priority and deadline (module docstring); ``objectives`` maps an
    ``InferenceObjective``'s name to its priority in flow control's order (an objective not
    named there sets none).

    Raises:
        ApiError: 400 for a priority that is not an integer or a deadline that is not a
            positive number of milliseconds.
    """
    header = headers.get("x-kvroute-priority")
    if header is not None:
        try:
            priority = int(header.strip())
        except ValueError:
            raise ApiError(400, "the x-kvroute-priority header must be an integer, got "
                           f"{header!r}") from None
    elif objectives and headers.get(OBJECTIVE_HEADER) in objectives:
        priority = objectives[headers[OBJECTIVE_HEADER]]
    else:
        priority = body.get("priority", 0)
        if priority is None:
            priority = 0
        elif isinstance(priority, bool) or not isinstance(priority, int):
            raise ApiError(400, f"priority must be an integer, got {priority!r}",
                           param="priority")
    deadline_s = None
    raw = headers.get("x-kvroute-ttft-deadline-ms")
    if raw is not None:
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if not (ms > 0 and math.isfinite(ms)):
            raise ApiError(400, "the x-kvroute-ttft-deadline-ms header must be a positive "
                           f"number of milliseconds, got {raw!r}")
        deadline_s = ms / 1000
    return Ask(priority, deadline_s, _output_limit(body))


def _output_limit(body: Mapping[str, Any]) -> int:
    """The output tokens ``body`` asks for at most (0: none named, or not a positive integer:
    the request's own check refuses that)."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(name)
        if type(value) is int and value > 0:
            return value
    return 0


def tenant_of(body: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    """A request's tenant: its ``x-kvroute-tenant`` header, else the gateway's fairness id,
    else its ``cache_salt`` (hashed), else its API key (hashed), else ``""``. Read only for a
    request that waits or is refused."""
    tenant = headers.get("x-kvroute-tenant", headers.get(FAIRNESS_HEADER))
    if tenant is not None:
        return tenant
    salt = body.get("cache_salt")
    if isinstance(salt, str) and salt:
        return f"salt:{hashlib.blake2b(salt.encode(), digest_size=6).hexdigest()}"
    auth = headers.get("authorization", "")
    return f"key:{hashlib.blake2b(auth.encode(), digest_size=6).hexdigest()}" if auth else ""


def _usage(route: Route, cost: WorkerCost) -> float:
    """The share of a candidate's device blocks its routed requests hold (0: unknown)."""
    entry = route.entries.get(cost.worker)
    blocks = entry.info.num_blocks if entry is not None and entry.info else 0
    return (cost.decode_blocks + cost.pending_prefill_blocks) / blocks if blocks else 0.0


def _queued(cost: WorkerCost) -> float:
    """Seconds the work queued on a candidate holds a new request's first token: its
    predicted TTFT less the request's own prefill."""
    return cost.cost - cost.prefill_s


def _loads(route: Route) -> list[tuple[WorkerCost, float, float]]:
    """Each candidate's ``(terms, queued seconds, kv usage)``, cheapest first."""
    return [(c, _queued(c), _usage(route, c)) for c in route.decision.costs]


def _yields(priority: int) -> bool:
    """Whether a request of ``priority`` leaves the urgent's share of sequences free: one less
    urgent than the default priority, 0 (:mod:`router.routing.dispatch_gate`)."""
    return priority > 0


def _rebound(route: Route, worker: int) -> Route:
    """``route`` sent to ``worker`` instead: the chosen one is saturated, a dearer one not."""
    return dataclasses.replace(route, decision=Decision(worker, route.decision.costs))


class FlowControl:
    """The queue and its dispatcher (module docstring).

    The dispatcher wakes when capacity may have freed: a request ended or gave its first
    token (:meth:`ended`, :meth:`wake`), a worker reported its load (:meth:`reported`), an
    arrival joined the queue; and otherwise every ``tick_s``, a safety net for a change
    nothing announces.

    Args:
        settings: the bounds.
        decide_again: decides a waiting request again, from the route it was first given
            (:meth:`router.service.RouterService.decide_again`: the route carries its request).
        clock: monotonic seconds.
        tick_s: seconds between looks at a saturated fleet while requests wait and nothing
            wakes the dispatcher.
    """

    def __init__(self, settings: FlowSettings, decide_again: Callable[[Route], Route], *,
                 clock: Callable[[], float] = time.monotonic, tick_s: float = 0.1) -> None:
        self.settings = settings
        self._decide_again = decide_again
        self.queue = FlowQueue(settings)
        self._clock = clock
        self._tick = tick_s
        #: Each worker's limit of sequences (:mod:`router.routing.dispatch_gate`).
        self.limits = SeqLimits()
        #: Requests ended per second over the fleet: the pace the queue drains at.
        self.rate = CompletionRate()
        #: Requests that left the queue for a worker.
        self.dispatched = 0
        #: Each waiting request's place when it joined: (requests ahead, queue length).
        self._joined: dict[str, tuple[int, int]] = {}
        #: Each waiting request's output tokens asked (:attr:`Ask.output_tokens`).
        self._asked: dict[str, int] = {}
        #: When the waiting requests' waits are next checked at the pace of that moment.
        self._next_recheck = -math.inf
        #: Each waiting request's future and the route it was first given.
        self._waiting: dict[str, tuple[asyncio.Future[Route], Route]] = {}
        self._task: asyncio.Task[None] | None = None
        #: Set by an arrival that joins the queue: it may be the new head.
        self._wake = asyncio.Event()
        #: Requests refused, by reason and the metrics labels of their priority and tenant
        #: (a bounded key set whatever priorities and tenants clients name).
        self.shed: Counter[tuple[str, str, str]] = Counter()
        #: Called with each request's priority, tenant and seconds waited as it leaves the
        #: queue.
        self.on_wait: Callable[[int, str, float], None] | None = None
        #: Whether each worker was saturated when a decision last looked at it.
        self.saturated: dict[int, bool] = {}

    def wake(self) -> None:
        """Capacity may have freed (a first token, a worker's events): look at the queue."""
        if self.queue:
            self._wake.set()

    def ended(self, key: str = "") -> None:
        """Request ``key`` ended (answered, failed or abandoned): its sequence is free."""
        self.rate.ended(self._clock(), key or None)
        self.wake()

    def reported(self, worker: int, running: int, waiting: int) -> None:
        """``worker`` reported its running and waiting requests."""
        self.limits.reported(worker, running, waiting)
        self.wake()

    def forget(self, worker: int) -> None:
        """``worker`` left the fleet, or restarted."""
        self.limits.forget(worker)

    def _starts_soon(self, route: Route, c: WorkerCost, keep_room: bool, *,
                     asked: bool = True) -> bool:
        """Whether candidate ``c`` starts one more request at its next iteration, keeping the
        urgent's share of its sequences free when ``keep_room``
        (:mod:`router.routing.dispatch_gate`); ``asked``: for a request (a worker found at
        its limit is told to :attr:`limits`), not for ``/debug/route``."""
        if not self.settings.seq_gate:
            return True
        limit = self._limit(route, c.worker)
        keep = reserved(limit, self.settings.urgent_share) if keep_room else 0
        if starts_soon(c.active_requests, limit, keep):
            return True
        if asked and not starts_soon(c.active_requests, limit, 0):
            self.limits.held(c.worker)
        return False

    def _limit(self, route: Route, worker: int) -> int:
        """``worker``'s limit of sequences (0: unknown)."""
        entry = route.entries.get(worker)
        said = entry.info.max_num_seqs if entry is not None and entry.info else 0
        return self.limits.limit(worker, said)

    def _full(self, route: Route, c: WorkerCost, keep_room: bool) -> bool:
        return (worker_saturated(_queued(c), _usage(route, c), self.settings)
                or not self._starts_soon(route, c, keep_room))

    def _unsaturated(self, route: Route, keep_room: bool = False) -> int | None:
        """The cheapest candidate that is neither saturated nor at its limit of sequences
        (None: the fleet is full). The chosen one is checked first; the others only when it
        is full."""
        chosen = route.decision.chosen
        if not self._full(route, chosen, keep_room):
            if self.saturated.get(chosen.worker) is not False:
                if len(self.saturated) >= _MAX_SHOWN:  # workers come and go: stay bounded
                    self.saturated.clear()
                self.saturated[chosen.worker] = False
            return chosen.worker
        self.saturated = {c.worker: self._full(route, c, keep_room)
                          for c in route.decision.costs}
        return next((w for w, full in self.saturated.items() if not full), None)

    def _leaving(self, route: Route, head: Waiting) -> int | None:
        """The cheapest candidate the queue's ``head`` may leave for, leaving room for the
        urgent (:func:`~router.routing.admission.has_room`); None: none has room."""
        keep = self.queue.least_urgent(head)
        keep_seqs = keep and _yields(head.priority)

        def room(c: WorkerCost) -> bool:
            first = c.cost - c.wait_s - c.prefill_s
            return (has_room(_queued(c), c.prefill_s, first, c.pending_prefill_blocks > 0,
                             _usage(route, c), self.settings, keep_room=keep)
                    and self._starts_soon(route, c, keep_seqs))

        chosen = route.decision.chosen
        if room(chosen):
            return chosen.worker
        return next((c.worker for c in route.decision.costs if room(c)), None)

    def _refuse(self, shed: Shed) -> Refused:
        self.shed[shed.reason, priority_label(shed.priority),
                  self.settings.tenant_label(shed.tenant)] += 1
        return Refused(shed)

    def admit_now(self, route: Route, ask: Ask, tenant: Callable[[], str] = str
                  ) -> Route | None:
        """``route`` (or the same request sent to a dearer candidate with room) when it may go
        at once: flow control is off, or nobody waits and some candidate is not saturated.
        None: it must wait (:meth:`admit`).

        Raises:
            Refused: 429, it could go at once but its deadline cannot be met.
        """
        if not self.settings.enabled:
            return route
        free = None if self.queue else self._unsaturated(route, _yields(ask.priority))
        if free is None:
            return None
        now = self._clock()
        deadline = self.settings.deadline(ask.priority, now, ask.deadline_s)
        ttft = route.decision.chosen.cost
        if deadline is not None and now + ttft > deadline:
            raise self._refuse(Shed(route.request_id, "deadline", 1,
                                    f"the first token is predicted in {ttft:.3g} s, past "
                                    "the request's deadline", ask.priority, tenant()))
        self.rate.started(route.request_id, now, ask.output_tokens)
        return route if free == route.decision.worker else _rebound(route, free)

    async def admit(self, route: Route, ask: Ask, tenant: Callable[[], str] = str,
                    departure: Callable[[], asyncio.Future[Any]] | None = None) -> Route:
        """Let ``route`` go at once, hold it until the fleet has room (and return it decided
        again), or refuse it. ``tenant`` names its tenant, asked only when it waits.

        Args:
            route: the request, decided.
            ask: what it asks of flow control.
            tenant: gives its tenant.
            departure: gives a future that completes when the client has left (the same
                one at each call); asked only once the request waits. Its end takes the
                request out of the queue at once; a cancelled one is not a departure.

        Raises:
            Refused: 429, its deadline cannot be met, the queue is full, it waited too long or
                a more urgent request displaced it.
            ApiError: deciding it again failed (503: no worker is healthy).
            Departed: the client left while the request waited.
        """
        now_route = self.admit_now(route, ask, tenant)
        if now_route is not None:
            return now_route
        return await self.wait_for_room(route, ask, tenant, departure)

    async def wait_for_room(self, route: Route, ask: Ask, tenant: Callable[[], str] = str,
                            departure: Callable[[], asyncio.Future[Any]] | None = None
                            ) -> Route:
        """:meth:`admit` for a request :meth:`admit_now` did not let go: it joins the queue
        (or is refused), and is returned decided again once the fleet has room (the
        request path calls :meth:`admit_now` itself first, and awaits this only when it
        must wait).

        Raises:
            Refused, ApiError, Departed: as :meth:`admit`.
        """
        now = self._clock()
        deadline = self.settings.waiting_deadline(ask.priority, now, ask.deadline_s)
        ttft = route.decision.chosen.cost
        item = Waiting(route.request_id, ask.priority, tenant(), len(route.prompt.token_ids),
                       now, deadline)
        offer = self.queue.offer(item, now, ttft, self._drain(route), self._pace(route, now))
        for shed in offer.displaced:
            self._fail(shed.key, self._refuse(shed))
        if offer.refused is not None:
            raise self._refuse(offer.refused)
        future: asyncio.Future[Route] = asyncio.get_running_loop().create_future()
        self._joined[item.key] = (self.queue.requests_ahead(item.priority, item.finish),
                                  len(self.queue) - 1)
        self._asked[item.key] = ask.output_tokens
        self._waiting[item.key] = (future, route)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._dispatch())
        gone = departure() if departure is not None else None
        if gone is not None:
            def left(_: asyncio.Future[Any]) -> None:
                self._left(item, future, gone)
            gone.add_done_callback(left)
        try:
            return await future
        except asyncio.CancelledError:  # the handler is cancelled: the server stops
            self.queue.remove(item.key)
            self._waiting.pop(item.key, None)
            raise
        finally:
            if gone is not None:
                gone.remove_done_callback(left)
            self._joined.pop(item.key, None)
            self._asked.pop(item.key, None)

    def _left(self, item: Waiting, future: asyncio.Future[Route], gone: asyncio.Future[Any]
              ) -> None:
        """The client of waiting request ``item`` left (``gone`` completed): out of the queue
        now, and its handler told. Nothing when it already left the queue, or when ``gone``
        was cancelled (whoever cancelled it stopped caring)."""
        if future.done() or gone.cancelled():
            return
        self.queue.remove(item.key)
        self._waiting.pop(item.key, None)
        future.set_exception(Departed(self._clock() - item.arrived, gone.exception()))
        self.wake()  # the head may have changed

    def _pace(self, route: Route, now: float) -> float | None:
        """Seconds between requests leaving the queue while the gate holds them: one per
        request ended, at the fleet's measured rate (None: not measured yet, or the gate is
        off). Asked only while requests wait, so every sequence the gate lets the least
        urgent take is taken (a moment after an end aside): when every candidate's limit is
        known, the rate may also be read from them (:class:`CompletionRate`)."""
        if not self.settings.seq_gate:
            return None
        taken = 0
        for c in route.decision.costs:
            limit = self._limit(route, c.worker)
            if limit <= 0:
                taken = 0
                break
            taken += limit - reserved(limit, self.settings.urgent_share)
        rate = self.rate.per_second(now, taken)
        return None if rate is None else 1.0 / rate

    def _drain(self, route: Route) -> float:
        """Seconds the fleet takes to clear one queued prompt token: the chosen worker's
        prefill of this prompt per token, shared by every candidate."""
        chosen = route.decision.chosen
        tokens = max(len(route.prompt.token_ids), 1)
        return chosen.prefill_s / tokens / max(len(route.entries), 1)

    def _fail(self, key: str, error: ApiError) -> None:
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter[0].done():
            waiter[0].set_exception(error)

    async def _dispatch(self) -> None:
        """Send the queue's head on whenever some candidate has room; shed what expires."""
        while self.queue:
            head = self.queue.head()
            assert head is not None, "a non-empty queue has a head"
            future, first = self._waiting[head.key]
            try:
                route = self._decide_again(first)
            except ApiError as exc:  # no healthy worker now: every waiting request hears it
                for key in list(self._waiting):
                    self.queue.remove(key)
                    self._fail(key, exc)
                return
            now = self._clock()
            pace = None
            if now >= self._next_recheck:  # the waits at the pace now, a few times a second
                self._next_recheck = now + _RECHECK_S
                pace = self._pace(route, now)
            for shed in self.queue.expire(now, route.decision.chosen.cost, pace):
                self._fail(shed.key, self._refuse(shed))
            if head.key not in self.queue:
                continue
            worker = self._leaving(route, head)
            if worker is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # a freed sequence, or a tick
                    await asyncio.wait_for(self._wake.wait(), self._tick)
                continue
            if worker != route.decision.worker:
                route = _rebound(route, worker)
            self.queue.pop()
            self.dispatched += 1
            self._waiting.pop(head.key, None)
            if not future.done():
                ahead, length = self._joined.get(head.key, (0, 0))
                route.queued = QueueStay(now - head.arrived, ahead, length)
                self.rate.started(route.request_id, now, self._asked.get(head.key, 0))
                future.set_result(route)
                if self.on_wait is not None:
                    self.on_wait(head.priority, head.tenant, now - head.arrived)
            # Let the handler book the request on its worker before the next decision reads
            # the loads (it does so before its first suspension).
            await asyncio.sleep(0)

    async def close(self) -> None:
        """Stop the dispatcher; every waiting request is answered 503."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for key in list(self._waiting):
            self.queue.remove(key)
            self._fail(key, ApiError(503, "the router is stopping", "service_unavailable"))

    def explain(self, route: Route, ask: Ask, tenant: str) -> dict[str, Any]:
        """What flow control would do with ``route`` now, for ``/debug/route``."""
        if not self.settings.enabled:
            return {"enabled": False}
        now = self._clock()
        yields = _yields(ask.priority)
        free = self._unsaturated(route, yields)
        ttft = route.decision.chosen.cost
        if free is not None and not self.queue:
            deadline = self.settings.deadline(ask.priority, now, ask.deadline_s)
            would = ("shed: deadline" if deadline is not None and now + ttft > deadline
                     else "dispatch")
        else:
            deadline = self.settings.waiting_deadline(ask.priority, now, ask.deadline_s)
            pace = self._pace(route, now)
            if pace is None:
                expected = ttft + self.queue.tokens_ahead(ask.priority) * self._drain(route)
            else:
                expected = ttft + (self.queue.requests_ahead(ask.priority) + 1) * pace
            if deadline is not None and now + expected > deadline:
                would = "shed: deadline"
            elif len(self.queue) >= self.settings.max_queue:
                would = "shed: queue_full (unless it displaces a less urgent request)"
            else:
                would = "wait"
        rate = self.rate.per_second(now)  # the ends alone
        return {"enabled": True, "would": would, "priority": ask.priority,
                "tenant": tenant, "weight": self.settings.weight(tenant),
                "fleet_saturated": free is None,
                "ttft_bound_s": self.settings.ttft_bound_s,
                "kv_threshold": self.settings.kv_threshold,
                "seq_gate": self.settings.seq_gate,
                "ttft_budget_s": self.settings.ttft_budget_s,
                "ends_per_s": None if rate is None else round(rate, 3),
                "queued": self.queue.lengths(),
                "workers": [{"id": c.worker, "predicted_ttft_s": c.cost, "queued_s": q,
                             "kv_usage": round(k, 4),
                             "in_flight": c.active_requests,
                             "seq_limit": self._limit(route, c.worker),
                             "starts_soon": self._starts_soon(route, c, yields, asked=False),
                             "saturated": worker_saturated(q, k, self.settings)}
                            for c, q, k in _loads(route)]}
