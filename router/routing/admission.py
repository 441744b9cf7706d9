"""Flow control: when the fleet is saturated, and the queue a request waits in while it is.

**Saturation.** A worker is saturated when the work queued there would hold a new request's
first token past ``ttft_bound_s``: its predicted time to first token less the request's own
prefill (the wait for the prefill and decode ahead of it, plus the fixed first iteration), so
that a long prompt on an idle worker never counts as overload. It is also saturated when its
KV usage (blocks held by the requests routed there, over its device blocks) exceeds
``kv_threshold``. The fleet is saturated when every candidate is. The chosen worker is checked
first: when it is not saturated the request goes at once, at the cost of one comparison.

**The queue.** A request that finds the fleet saturated (or finds others already waiting)
waits in the router. It is bound to a worker only when it leaves (late binding): the caller
decides it again then, with the index and loads of that moment.

**Room kept for the urgent** (:func:`has_room`). The bound is the work an urgent arrival finds
queued ahead of it. A waiting request more urgent than some other waiting one leaves when the
work queued on a worker is within the bound, as an arrival does. One of the least urgent band
waiting leaves only when the work it leaves queued, its own prefill added, stays within the
bound: otherwise each dispatch pushes the queue past the bound by one prompt, and an urgent
arrival then waits that prompt in the engine and, in the router, for the books to fall back
under the bound. A prompt whose prefill and first iteration alone exceed the bound goes to a
worker with no prefill queued, so it is never held for good. The queue holds one band per
priority; the band of the most urgent priority is served first (lower numbers first, as vLLM's
``priority`` field reads). Inside a band, tenants share by start-time fair queuing on tokens:
each request gets ``start = max(V, last finish of its tenant)`` and ``finish = start + tokens /
weight``; the waiting request with the least ``finish`` leaves first and ``V`` becomes its
``start``. A backlogged tenant of weight ``w`` thus gets tokens in proportion to ``w``, however
many requests the others send, and a long prompt counts for its length, not as one request.

**Deadlines and shedding.** A request may carry a deadline for its first token (monotonic
seconds); one that must wait and has none gets the TTFT budget's (``ttft_budget_s``). On
arrival it is refused at once (429, with a ``Retry-After``) when it cannot meet it: the best
predicted TTFT now, plus its wait, ends past the deadline. The wait is the requests leaving
before it, and itself, at the pace the fleet's requests end (measured by the caller:
:class:`~router.routing.dispatch_gate.CompletionRate`), or, before that is measured, the
seconds the fleet needs to drain the tokens queued ahead of it. A full queue sheds its least
urgent request (the one of the lowest priority that would leave last) to admit a more urgent
arrival, or refuses the arrival when nothing queued is less urgent. A waiting request is shed
when its deadline can no longer be met or it has waited ``max_wait_s``.

Pure: the caller passes ``now`` (monotonic seconds), the predicted TTFT and the drain rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

__all__ = ["OTHER_TENANTS", "SHED_REASONS", "FlowQueue", "FlowSettings", "Offer", "Shed",
           "Waiting", "fleet_saturated", "has_room", "priority_label", "retry_after",
           "worker_saturated"]

#: Why a request was refused: its deadline could not be met (on arrival or while waiting),
#: the queue was full, it waited the longest allowed, it was displaced by a more urgent one.
SHED_REASONS = ("deadline", "queue_full", "timeout", "displaced")

#: Priorities shown as themselves in metrics; the rest as ``"low"`` or ``"high"``.
_LABELLED = range(-10, 11)

#: The metrics label of every tenant not named in the weights.
OTHER_TENANTS = "other"


def priority_label(priority: int) -> str:
    """The metrics label of ``priority``: a bounded set whatever clients send."""
    if priority in _LABELLED:
        return str(priority)
    return "high" if priority < _LABELLED.start else "low"


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowSettings:
    """Flow control's bounds (the router's flags, read once).

    Raises:
        ValueError: a bound is not positive, or a weight or deadline is not.
    """

    enabled: bool = True
    #: A worker whose queued work would hold a new request's first token past this many
    #: seconds (its predicted TTFT less the request's own prefill) is saturated.
    ttft_bound_s: float = 10.0
    #: A worker whose KV usage is above this share of its device blocks is saturated (0: KV
    #: usage is not checked; the router's books count a shared prefix once per request, so
    #: their usage is an upper bound).
    kv_threshold: float = 0.0
    #: Requests the queue holds at most.
    max_queue: int = 4096
    #: Seconds a request waits at most.
    max_wait_s: float = 60.0
    #: A TTFT deadline per priority, in seconds from arrival (a header may set one).
    deadlines: Mapping[int, float] = field(default_factory=dict)
    #: Each tenant's weight inside its priority (1 when not named).
    weights: Mapping[str, float] = field(default_factory=dict)
    #: Send a request to a worker only while it runs fewer sequences than it can
    #: (:mod:`router.routing.dispatch_gate`); the rest wait in the router's queue.
    seq_gate: bool = True
    #: The share of each worker's sequences a request less urgent than the default keeps
    #: free for more urgent ones (at least one; 0: none).
    urgent_share: float = 0.0625
    #: Seconds a request that must wait may take to its first token, when neither a header
    #: nor its priority sets a deadline (0: none): one predicted to wait in the router past
    #: it is refused at once.
    ttft_budget_s: float = 30.0

    def __post_init__(self) -> None:
        if not (self.kv_threshold >= 0 and math.isfinite(self.kv_threshold)):
            raise ValueError(f"flow control's kv_threshold must be a finite number >= 0, "
                             f"got {self.kv_threshold}")
        for name in ("ttft_bound_s", "max_wait_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"flow control's {name} must be a finite number > 0, "
                                 f"got {value}")
        for name in ("ttft_budget_s", "urgent_share"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"flow control's {name} must be a finite number >= 0, "
                                 f"got {value}")
        if self.urgent_share >= 1:
            raise ValueError("flow control's urgent_share must be below 1, got "
                             f"{self.urgent_share}")
        if self.max_queue < 0:
            raise ValueError(f"flow control's max_queue must be >= 0, got {self.max_queue}")
        for what, table in (("deadline", self.deadlines), ("weight", self.weights)):
            for key, value in table.items():
                if not (value > 0 and math.isfinite(value)):
                    raise ValueError(f"the {what} of {key!r} must be a finite number > 0, "
                                     f"got {value}")

    def weight(self, tenant: str) -> float:
        """``tenant``'s weight (1 when not configured)."""
        return self.weights.get(tenant, 1.0)

    def tenant_label(self, tenant: str) -> str:
        """The metrics label of ``tenant``: its name when the weights name it, else
        :data:`OTHER_TENANTS`, so the label set is the configuration's, whatever clients
        send."""
        return tenant if tenant in self.weights else OTHER_TENANTS

    def deadline(self, priority: int, arrived: float, header_s: float | None) -> float | None:
        """The absolute deadline of a request: its header's seconds, else its priority's."""
        seconds = header_s if header_s is not None else self.deadlines.get(priority)
        return None if seconds is None else arrived + seconds

    def waiting_deadline(self, priority: int, arrived: float, header_s: float | None
                         ) -> float | None:
        """The absolute deadline of a request that must wait: :meth:`deadline`, else the
        TTFT budget's (None: neither)."""
        deadline = self.deadline(priority, arrived, header_s)
        if deadline is None and self.ttft_budget_s > 0:
            return arrived + self.ttft_budget_s
        return deadline


def worker_saturated(queued_s: float, kv_usage: float, settings: FlowSettings) -> bool:
    """Whether a worker whose queued work would hold a first token ``queued_s`` seconds, with
    ``kv_usage`` of its device blocks held, is saturated."""
    return queued_s > settings.ttft_bound_s or 0 < settings.kv_threshold < kv_usage


def has_room(queued_s: float, prefill_s: float, first_s: float, prefill_queued: bool,
             kv_usage: float, settings: FlowSettings, *, keep_room: bool) -> bool:
    """Whether a worker may take a request leaving the queue (module docstring).

    Args:
        queued_s: seconds the work queued there holds a new first token (its fixed first
            iteration included).
        prefill_s: the request's own prefill there, in seconds.
        first_s: the fixed part of a first token (one iteration).
        prefill_queued: whether any prefill is queued there.
        kv_usage: the share of its device blocks held.
        settings: the bounds.
        keep_room: the request is of the least urgent band waiting: it must leave the bound's
            room for a more urgent arrival.
    """
    if 0 < settings.kv_threshold < kv_usage:
        return False
    bound = settings.ttft_bound_s
    if not keep_room:
        return queued_s <= bound
    if queued_s + prefill_s <= bound:
        return True
    return prefill_s + first_s > bound and not prefill_queued  # a prompt longer than the bound


def fleet_saturated(loads: Iterator[tuple[float, float]] | list[tuple[float, float]],
                    settings: FlowSettings) -> bool:
    """Whether every candidate, given as ``(queued_s, kv_usage)``, is saturated (an empty
    fleet is not: nothing healthy is a 503, not a wait)."""
    seen = False
    for queued_s, kv_usage in loads:
        if not worker_saturated(queued_s, kv_usage, settings):
            return False
        seen = True
    return seen


def retry_after(seconds: float) -> int:
    """Whole seconds for a ``Retry-After`` header: at least 1."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 1


@dataclass(slots=True)
class Waiting:
    """A request in the queue."""

    key: str
    priority: int
    tenant: str
    #: Its prompt's tokens: what it costs its tenant's share.
    tokens: int
    arrived: float
    #: Monotonic seconds by which its first token is due (None: none).
    deadline: float | None = None
    start: float = 0.0
    finish: float = 0.0
    seq: int = 0


@dataclass(frozen=True, slots=True)
class Shed:
    """A request refused: why, and when to try again."""

    key: str
    reason: str
    retry_after_s: int
    message: str
    priority: int = 0
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class Offer:
    """What became of an offered request: ``refused`` when it was not queued, and the
    requests it displaced when it was."""

    refused: Shed | None = None
    displaced: tuple[Shed, ...] = ()


@dataclass(slots=True)
class _Band:
    items: dict[str, Waiting] = field(default_factory=dict)
    virtual: float = 0.0
    last_finish: dict[str, float] = field(default_factory=dict)
    tokens: int = 0


class FlowQueue:
    """Requests waiting for a saturated fleet: priority bands, fair shares of tokens between
    tenants inside a band, deadlines, bounded length and wait (module docstring).

    Invariants:
        1. Every waiting request is in exactly one band, the one of its priority.
        2. A band's ``tokens`` is the sum of its requests' tokens.
        3. :meth:`pop` returns the request of the most urgent band with the least ``finish``
           (ties: the earlier arrival).
    """

    def __init__(self, settings: FlowSettings) -> None:
        self.settings = settings
        self._bands: dict[int, _Band] = {}
        self._where: dict[str, int] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def lengths(self) -> dict[int, int]:
        """Waiting requests per priority."""
        return {p: len(b.items) for p, b in sorted(self._bands.items()) if b.items}

    def counts(self) -> dict[tuple[int, str], int]:
        """Waiting requests per priority and tenant."""
        out: dict[tuple[int, str], int] = {}
        for p, band in self._bands.items():
            for w in band.items.values():
                out[p, w.tenant] = out.get((p, w.tenant), 0) + 1
        return out

    def least_urgent(self, item: Waiting) -> bool:
        """Whether ``item`` is of the least urgent band waiting (:func:`has_room`)."""
        return item.priority >= max((p for p, b in self._bands.items() if b.items),
                                    default=item.priority)

    def tokens_ahead(self, priority: int, finish: float = math.inf) -> int:
        """Tokens that leave before a request of ``priority`` whose finish tag is ``finish``:
        every more urgent band's, and its own band's with a smaller tag."""
        total = 0
        for p, band in self._bands.items():
            if p < priority:
                total += band.tokens
            elif p == priority:
                total += (band.tokens if finish == math.inf else
                          sum(w.tokens for w in band.items.values() if w.finish < finish))
        return total

    def requests_ahead(self, priority: int, finish: float = math.inf) -> int:
        """Requests that leave before a request of ``priority`` whose finish tag is
        ``finish`` (as :meth:`tokens_ahead` counts tokens)."""
        total = 0
        for p, band in self._bands.items():
            if p < priority:
                total += len(band.items)
            elif p == priority:
                total += (len(band.items) if finish == math.inf else
                          sum(1 for w in band.items.values() if w.finish < finish))
        return total

    def _tags(self, item: Waiting) -> tuple[float, float]:
        band = self._bands.get(item.priority)
        virtual = band.virtual if band else 0.0
        last = band.last_finish.get(item.tenant, 0.0) if band else 0.0
        start = max(virtual, last)
        return start, start + max(item.tokens, 1) / self.settings.weight(item.tenant)

    def offer(self, item: Waiting, now: float, ttft_s: float, drain_s_per_token: float,
              drain_s_per_request: float | None = None) -> Offer:
        """Queue ``item`` unless it cannot meet its deadline or the queue is full of more
        urgent requests.

        Args:
            item: the request (its ``key`` not already queued).
            now: monotonic seconds.
            ttft_s: the least predicted TTFT in the fleet now.
            drain_s_per_token: seconds the fleet takes to clear one queued token.
            drain_s_per_request: seconds between requests leaving the queue, as measured
                (:class:`~router.routing.dispatch_gate.CompletionRate`); when given, the wait
                is the requests leaving before it, and itself, at that pace, not its tokens.

        Raises:
            ValueError: ``item.key`` is already queued.
        """
        if item.key in self._where:
            raise ValueError(f"request {item.key!r} is already queued")
        start, finish = self._tags(item)
        if drain_s_per_request is None:
            expected = ttft_s + self.tokens_ahead(item.priority, finish) * drain_s_per_token
        else:
            ahead = self.requests_ahead(item.priority, finish) + 1
            expected = ttft_s + ahead * drain_s_per_request
        if item.deadline is not None and now + expected > item.deadline:
            return Offer(Shed(item.key, "deadline", retry_after(expected),
                              f"the first token is predicted in {expected:.3g} s, past the "
                              f"request's deadline", item.priority, item.tenant))
        displaced: tuple[Shed, ...] = ()
        if len(self._where) >= self.settings.max_queue:
            victim = self._least_urgent()
            if victim is None or victim.priority <= item.priority:
                return Offer(Shed(item.key, "queue_full", retry_after(expected),
                                  "the router's queue is full", item.priority, item.tenant))
            self.remove(victim.key)
            displaced = (Shed(victim.key, "displaced", retry_after(expected),
                              "displaced from the router's queue by a more urgent request",
                              victim.priority, victim.tenant),)
            start, finish = self._tags(item)
        band = self._bands.setdefault(item.priority, _Band())
        item.start, item.finish, item.seq = start, finish, self._seq
        self._seq += 1
        band.items[item.key] = item
        band.last_finish[item.tenant] = finish
        band.tokens += item.tokens
        self._where[item.key] = item.priority
        return Offer(None, displaced)

    def _least_urgent(self) -> Waiting | None:
        if not self._where:
            return None
        band = self._bands[max(p for p, b in self._bands.items() if b.items)]
        return max(band.items.values(), key=lambda w: (w.finish, w.seq))

    def head(self) -> Waiting | None:
        """The request that leaves next (invariant 3), left in the queue."""
        for p in sorted(self._bands):
            band = self._bands[p]
            if band.items:
                return min(band.items.values(), key=lambda w: (w.finish, w.seq))
        return None

    def pop(self) -> Waiting | None:
        """Take the request that leaves next; its band's virtual time moves to its start."""
        item = self.head()
        if item is None:
            return None
        self.remove(item.key)
        band = self._bands.get(item.priority)
        if band is not None:
            band.virtual = max(band.virtual, item.start)
        return item

    def remove(self, key: str) -> Waiting | None:
        """Take ``key`` out of the queue (it left: cancelled, shed); None if not queued. A
        band left empty forgets its tags, so the next arrivals start even."""
        priority = self._where.pop(key, None)
        if priority is None:
            return None
        band = self._bands[priority]
        item = band.items.pop(key)
        band.tokens -= item.tokens
        if not band.items:
            del self._bands[priority]
        return item

    def expire(self, now: float, ttft_s: float, pace_s: float | None = None) -> list[Shed]:
        """Shed every request that has waited ``max_wait_s``, or whose deadline a first token
        ``ttft_s`` from now would miss; given ``pace_s``, the seconds between requests
        leaving, also every one whose deadline a first token after its wait at that pace
        would miss (the requests leaving before it that stay, and itself): a prediction that
        grew past its deadline is told now, not at the deadline."""
        shed: list[Shed] = []
        limit = self.settings.max_wait_s
        for band in list(self._bands.values()):
            for item in list(band.items.values()):
                if now - item.arrived >= limit:
                    shed.append(Shed(item.key, "timeout", retry_after(ttft_s),
                                     f"waited {limit:.3g} s in the router's queue",
                                     item.priority, item.tenant))
                elif item.deadline is not None and now + ttft_s > item.deadline:
                    shed.append(Shed(item.key, "deadline", retry_after(ttft_s),
                                     "the request's deadline can no longer be met",
                                     item.priority, item.tenant))
        if pace_s is not None:
            gone = {s.key for s in shed}
            kept = 0
            for p in sorted(self._bands):
                for item in sorted(self._bands[p].items.values(),
                                   key=lambda w: (w.finish, w.seq)):
                    if item.key in gone:
                        continue
                    expected = ttft_s + (kept + 1) * pace_s
                    if item.deadline is not None and now + expected > item.deadline:
                        shed.append(Shed(item.key, "deadline", retry_after(expected),
                                         f"the first token is now predicted in "
                                         f"{expected:.3g} s, past the request's deadline",
                                         item.priority, item.tenant))
                    else:
                        kept += 1
        for s in shed:
            self.remove(s.key)
        return shed
