"""The dispatch gate: a request goes to a worker only when that worker can start it soon.

An engine runs at most ``max_num_seqs`` sequences; a request sent past them waits in the
engine's own queue, first come first served, where the router's priorities, tenant shares and
deadlines no longer apply: an urgent chat sent behind a flood of batch chats waits for the
flood there. So the router counts what each worker holds (its own books of in-flight requests
plus the foreign ones the worker's report counts) against the sequences it runs, and holds the
rest in its queue (:class:`~router.routing.admission.FlowQueue`), which sends the most urgent
on as each sequence frees.

**The sequences a worker runs** (:class:`SeqLimits`). A kvroute worker says its
``max_num_seqs`` in ``/model_info``; that is the limit. A stock engine does not, so its limit
is learned from its reports (``running``/``waiting`` from its metrics): a report with requests
waiting while this router holds requests back, or sends it all it has, sets the limit to the
requests running then (at least 1); a report with none waiting while the router holds
requests back at the limit raises it by a quarter (at least 1), so a limit learned low in a
moment's queue grows back. Until a stock engine's first report with requests waiting, its
limit is unknown and the gate is open (the saturation bound alone applies).

**Room kept for the urgent** (:func:`reserved`). A request of a priority less urgent than the
default (``priority`` > 0), when nothing more urgent waits, leaves a share of each worker's
sequences free (``urgent_share``, at least one), so an urgent arrival starts at the next
iteration instead of waiting for a flood's sequence to end.

**The rate the queue drains** (:class:`CompletionRate`): requests ended per second over the
fleet, over the last :data:`RATE_WINDOW` ends, or, while every sequence is taken, the
sequences over the mean time a request holds one, when that is more. While the gate holds
requests, each end frees a sequence, so a request with ``n`` requests leaving before it waits
about ``n / rate`` seconds;
with its predicted TTFT added, that is what flow control compares with what the client can be
served within (:mod:`router.routing.admission`). The time a request holds a sequence is read
from those that ended, from the age of those running, and from the output tokens the running
ones asked for (``max_tokens``) at the seconds per asked token the ended ones took: at a
flood's onset the first is the load before it and the second grows only as the flood ages, so
without the third a request refused later was let wait first (docs/flow_control.md).

Pure: the caller passes ``now`` (monotonic seconds) and the counts.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple, Protocol

__all__ = ["RATE_WINDOW", "CapacityListener", "CompletionRate", "Deaf", "QueueStay", "SeqLimits",
           "reserved", "starts_soon"]

#: Request ends the drain rate is measured over.
RATE_WINDOW = 64
#: Ends needed before a rate is given.
_MIN_ENDS = 4
#: Requests running the pace keeps the start of at most (one never said to end is dropped).
_MAX_RUNNING = 65536


class QueueStay(NamedTuple):
    """A request's stay in the router's queue, as its answer's ``x-kvroute-queue-*`` headers
    show it."""

    #: Seconds it waited.
    waited_s: float
    #: Requests waiting that were to leave before it when it joined.
    ahead: int
    #: Requests waiting when it joined.
    length: int


class CapacityListener(Protocol):
    """Told of what may free capacity on the fleet (flow control listens)."""

    def ended(self, key: str) -> None:
        """Request ``key`` ended: its sequence is free."""

    def wake(self) -> None:
        """A worker's load changed (a first token, its KV events)."""

    def reported(self, worker: int, running: int, waiting: int) -> None:
        """``worker`` reported its running and waiting requests."""

    def forget(self, worker: int) -> None:
        """``worker`` left the fleet, or restarted."""


class Deaf:
    """A :class:`CapacityListener` that ignores everything (nothing listens yet)."""

    def ended(self, key: str) -> None:
        """Ignored."""

    def wake(self) -> None:
        """Ignored."""

    def reported(self, worker: int, running: int, waiting: int) -> None:
        """Ignored."""

    def forget(self, worker: int) -> None:
        """Ignored."""


def reserved(limit: int, urgent_share: float) -> int:
    """Sequences of a worker running ``limit`` kept for the urgent: ``urgent_share`` of them,
    at least one (none when the share is 0, or the limit is 1 or unknown)."""
    if urgent_share <= 0 or limit <= 1:
        return 0
    return min(limit - 1, max(1, math.ceil(limit * urgent_share)))


def starts_soon(in_flight: int, limit: int, keep: int) -> bool:
    """Whether a worker holding ``in_flight`` requests, running ``limit`` sequences at most (0:
    unknown), starts one more at its next iteration while keeping ``keep`` sequences free."""
    return limit <= 0 or in_flight + keep < limit


class SeqLimits:
    """Each worker's limit of sequences: its own word, else learned (module docstring).

    Invariant: a learned limit is at least 1.
    """

    def __init__(self) -> None:
        self._learned: dict[int, int] = {}
        #: Workers the gate held requests back from (at their limit) since their last report.
        self._held: set[int] = set()

    def limit(self, worker: int, max_num_seqs: int) -> int:
        """``worker``'s limit: ``max_num_seqs`` when it says one (> 0), else the learned one
        (0: unknown)."""
        if max_num_seqs > 0:
            return max_num_seqs
        return self._learned.get(worker, 0)

    def held(self, worker: int) -> None:
        """The gate held a request back from ``worker`` because it was at its limit."""
        self._held.add(worker)

    def reported(self, worker: int, running: int, waiting: int) -> None:
        """``worker`` reported ``running`` and ``waiting`` requests (stock engines' metrics,
        a kvroute worker's ``/load``)."""
        held = worker in self._held
        self._held.discard(worker)
        learned = self._learned.get(worker)
        if waiting > 0 and (held or learned is None):
            self._learned[worker] = max(1, running)
        elif waiting == 0 and held and learned is not None:
            self._learned[worker] = learned + max(1, learned // 4)

    def forget(self, worker: int) -> None:
        """``worker`` left (or restarted): what was learned of it no longer holds."""
        self._learned.pop(worker, None)
        self._held.discard(worker)


class CompletionRate:
    """The pace requests end at over the fleet (module docstring): ends per second over the
    last :data:`RATE_WINDOW` ends, and, while every sequence is taken, the sequences over
    the mean time a request holds one (Little's law).

    The second is what a flood's onset needs: the ends seen then are those of the load before
    it, far fewer than a full fleet gives, while the requests it started have not ended yet.
    So a request's time holding a sequence is the longest of: the mean of the window's ended
    ones; the mean age of those still running (each has held its sequence that long at
    least); and, for the running ones that named an output limit, the mean of the tokens
    they asked for times the seconds per asked token of the window's ended ones that named
    one. The last is what the fleet can know before the flood's first request ends: a flood
    of 400-token chats after a load of 16-token ones holds each sequence 25 times as long,
    which neither the ends nor the young ages show. Calibrated on what the ended ones took of
    what they asked, requests that stop short of their limit count as short.

    Invariants: ``_start_sum`` is the sum of ``_running``'s start times, ``_running_asked``
    and ``_running_asking`` the sum and count of its asked tokens that are above 0;
    ``_held_sum`` is the sum of ``_held``'s seconds, ``_asked_held_sum`` and ``_asked_sum``
    the sums of its seconds and tokens where tokens are above 0.
    """

    def __init__(self, window: int = RATE_WINDOW) -> None:
        if window < 2:
            raise ValueError(f"the window must hold at least 2 ends, got {window}")
        self._ends: deque[float] = deque(maxlen=window)
        #: The window's ended requests: (seconds held, output tokens asked; 0: none named).
        self._held: deque[tuple[float, int]] = deque(maxlen=window)
        self._held_sum = 0.0
        self._asked_held_sum = 0.0
        self._asked_sum = 0
        #: Running requests: (start, output tokens asked).
        self._running: dict[str, tuple[float, int]] = {}
        self._start_sum = 0.0
        self._running_asked = 0
        self._running_asking = 0

    def started(self, key: str, now: float, asked: int = 0) -> None:
        """Request ``key`` went to a worker at ``now``, asking for at most ``asked`` output
        tokens (0: it named no limit)."""
        if key in self._running:
            return
        if len(self._running) >= _MAX_RUNNING:  # one never told to have ended: forget it
            self._stop(next(iter(self._running)))
        asked = max(asked, 0)
        self._running[key] = (now, asked)
        self._start_sum += now
        if asked:
            self._running_asked += asked
            self._running_asking += 1

    def _stop(self, key: str) -> tuple[float, int] | None:
        """Take ``key`` out of the running ones; its start and asked tokens (None: unknown)."""
        run = self._running.pop(key, None)
        if run is None:
            return None
        self._start_sum -= run[0]
        if run[1]:
            self._running_asked -= run[1]
            self._running_asking -= 1
        if not self._running:
            self._start_sum = 0.0  # no float residue
        return run

    def ended(self, now: float, key: str | None = None) -> None:
        """A request (``key``, when known) ended at ``now``."""
        self._ends.append(now)
        run = self._stop(key) if key is not None else None
        if run is None:
            return
        start, asked = run
        if len(self._held) == self._held.maxlen:
            old_held, old_asked = self._held[0]
            self._held_sum -= old_held
            if old_asked:
                self._asked_held_sum -= old_held
                self._asked_sum -= old_asked
        held = now - start
        self._held.append((held, asked))
        self._held_sum += held
        if asked:
            self._asked_held_sum += held
            self._asked_sum += asked

    def per_second(self, now: float, sequences: int = 0) -> float | None:
        """Requests a second the fleet ends: the greater of the window's ends per second
        (from its oldest to ``now``, so a fleet that stops answering drains ever slower) and,
        given the ``sequences`` that are all taken, those over the time a request holds one
        (the class docstring). None before :data:`_MIN_ENDS` ends."""
        if len(self._ends) < _MIN_ENDS:
            return None
        span = now - self._ends[0]
        rate = len(self._ends) / span if span > 0 else None
        if sequences > 0 and len(self._held) >= _MIN_ENDS:
            held = self._held_sum / len(self._held)
            if self._running:
                held = max(held, now - self._start_sum / len(self._running))
            if self._running_asking and self._asked_sum:
                per_token = self._asked_held_sum / self._asked_sum
                held = max(held, per_token * self._running_asked / self._running_asking)
            if held > 0:
                rate = max(rate or 0.0, sequences / held)
        return rate
