"""The router's accounting of load on each worker, corrected by what workers report.

Own accounting, updated as requests move (the router sees every byte it forwards):

- routed: the request's uncached blocks become pending prefill; it counts as active. A
  request told to fetch its prefix from a peer is *fetching*: booked, but not yet in its
  worker's queue (the worker runs it once the blocks are in) until :meth:`LoadTracker.
  queued` says its fetch is over; it then joins the queue behind the requests there.
- first token: its prefill is done; its blocks (prompt + expected output) count as decode.
- finished (or failed, or cancelled): everything it held is released.

The head's progress: a worker prefills our requests in the order they came (chunked prefill
gives the oldest running prompt its chunk first, then admits the waiting ones first come,
first served), so only the oldest one still prefilling, the *head*, is under way. The device
blocks its KV events store (:meth:`LoadTracker.stored`) are the head's progress; its booked
seconds less the seconds of those blocks are what is left of it. A head that gives its first
token leaves the blocks stored past its own to the next head (the iteration that finished it
computed the next one's first chunk); the count is 0 whenever nothing is prefilling.

A request told to fetch its prompt's leading blocks from a peer reaches its worker's engine
only when they are in: until its fetch is over (:meth:`LoadTracker.queued`) it is booked,
and counted as prefilling, but is no part of the queue, so it is never the head. Queued at
once, a fetching request ahead in the books took the stores of the request the engine ran
meanwhile as its own, and that request, giving its first token behind it, left them in the
count, which carried them from head to head: on the trace's tail at x4.4, 1,539 blocks past
a 191k-token prompt's, so its worker was priced 3.5 s short for 6 s and took more requests.

Correction: each worker's ``GET /load`` reports what it really has (running, waiting, pending
prefill tokens, KV blocks in use). Requests sent by other router replicas, or straight to the
worker, appear there and not in our books; so when the worker counts more requests than we
sent it, the tracker keeps ``external = max(0, reported - own at report time)`` per term and
adds it to its own figures until the next report. When it counts no more requests than ours,
there is no foreign load, whatever the phases say (our books cannot see a non-streamed
request's first token). A report never lowers our own books: our in-flight requests are facts
we saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LoadTracker", "ReportedLoad", "WorkerLoad"]


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    """A worker's ``/load`` answer, in blocks."""

    running: int = 0
    waiting: int = 0
    pending_prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    #: The share of the worker's KV cache in use (0 when it does not say).
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The load the rule weighs for one worker."""

    active_requests: int
    #: Ours and the worker's report's foreign ones.
    pending_prefill_blocks: float
    decode_blocks: float
    #: Seconds of prefill booked for our requests (at the rates they were priced at).
    pending_prefill_s: float = 0.0
    #: Foreign prefill from the worker's report, in blocks (priced at the worker's rates).
    external_prefill_blocks: float = 0.0
    #: Our requests routed there that have not given their first token.
    prefilling: int = 0


@dataclass(slots=True)
class _Request:
    worker: int
    prefill_blocks: float
    decode_blocks: float
    prefill_s: float
    #: Seconds of its prefill done once ``p`` of its blocks are stored: ``lin * p + quad *
    #: p * p`` (at the rates it was booked at; :meth:`LoadTracker.stored`).
    lin: float = 0.0
    quad: float = 0.0
    prefilled: bool = False


@dataclass(slots=True)
class _Books:
    active: int = 0
    prefill: float = 0.0
    decode: float = 0.0
    prefill_s: float = 0.0
    external_active: int = 0
    external_prefill: float = 0.0
    external_decode: float = 0.0
    requests: set[str] = field(default_factory=set)
    #: Our requests still prefilling, in the order they were routed (the first: the head).
    queue: dict[str, _Request] = field(default_factory=dict)
    #: Our requests still fetching their prefix, not yet queued.
    fetching: dict[str, _Request] = field(default_factory=dict)
    #: Device blocks the worker stored since the head became the head.
    progress: int = 0
    report: ReportedLoad | None = None


class LoadTracker:
    """In-flight requests per worker, with each worker's reported load folded in.

    Every change names the worker whose figures it may have changed: :meth:`first_token` and
    :meth:`finished` return it (None: nothing changed), the others take it (the routing core
    keeps its workers ordered by load with it).
    """

    def __init__(self) -> None:
        self._books: dict[int, _Books] = {}
        self._requests: dict[str, _Request] = {}
        self._prefilling = 0  # the books' queues' lengths, summed

    def add_worker(self, worker: int) -> None:
        """Start tracking ``worker`` (idempotent)."""
        if worker not in self._books:
            self._books[worker] = _Books()

    def tracked(self, worker: int) -> bool:
        """Whether ``worker`` is tracked."""
        return worker in self._books

    def remove_worker(self, worker: int) -> list[str]:
        """Stop tracking ``worker``; returns the ids of its in-flight requests."""
        books = self._books.pop(worker, None)
        if books is None:
            return []
        for rid in books.requests:
            self._requests.pop(rid, None)
        self._prefilling -= len(books.queue) + len(books.fetching)
        return sorted(books.requests)

    def routed(self, request_id: str, worker: int, prefill_blocks: float,
               decode_blocks: float, prefill_s: float = 0.0, lin: float = 0.0,
               quad: float = 0.0, fetching: bool = False) -> None:
        """A request was sent to ``worker``: ``prefill_blocks`` uncached blocks to prefill
        (``prefill_s`` seconds of work), then ``decode_blocks`` held while it decodes. ``lin``
        and ``quad`` give the seconds of its prefill done once p blocks are stored, ``lin * p
        + quad * p * p`` (attention makes later blocks dearer). ``fetching``: it fetches its
        prefix first, and joins the queue at :meth:`queued`.

        Raises:
            ValueError: the request id is already in flight, or the worker is unknown.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        books = self._books.get(worker)
        if books is None:
            raise ValueError(f"worker {worker} is not tracked")
        req = _Request(worker, prefill_blocks, decode_blocks, prefill_s, lin, quad)
        self._requests[request_id] = req
        books.requests.add(request_id)
        if fetching:
            books.fetching[request_id] = req
        else:
            books.queue[request_id] = req
        self._prefilling += 1
        books.active += 1
        books.prefill += prefill_blocks
        books.prefill_s += prefill_s

    def queued(self, request_id: str, rebooked: tuple[float, float, float] | None = None
               ) -> int | None:
        """A fetching request's fetch is over: it joins its worker's queue, last. Given
        ``rebooked``, ``(prefill_blocks, prefill_s, lin)`` as :meth:`routed` takes them (a
        fetch that failed: its blocks to compute after all), its booking becomes that.
        Returns its worker, or None when nothing changed (unknown, or not fetching)."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        books = self._books[req.worker]
        if books.fetching.pop(request_id, None) is None:
            return None
        if rebooked is not None:
            blocks, seconds, req.lin = rebooked
            books.prefill += blocks - req.prefill_blocks
            books.prefill_s += seconds - req.prefill_s
            req.prefill_blocks, req.prefill_s = blocks, seconds
        if not books.queue:
            books.progress = 0
        books.queue[request_id] = req
        return req.worker

    def first_token(self, request_id: str) -> int | None:
        """The request produced its first token: prefill done, decode begins. Returns its
        worker, or None when nothing changed (unknown, or prefilled already)."""
        req = self._requests.get(request_id)
        if req is None or req.prefilled:
            return None
        req.prefilled = True
        books = self._books[req.worker]
        self._dequeue(books, request_id)
        books.prefill -= req.prefill_blocks
        books.prefill_s -= req.prefill_s
        books.decode += req.decode_blocks
        return req.worker

    def finished(self, request_id: str) -> int | None:
        """The request ended (success, error or cancel); releases what it held. Returns its
        worker, or None when nothing changed (unknown, or its worker removed)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        books = self._books.get(req.worker)
        if books is None:
            return None
        books.requests.discard(request_id)
        books.active -= 1
        if req.prefilled:
            books.decode -= req.decode_blocks
        else:
            self._dequeue(books, request_id)
            books.prefill -= req.prefill_blocks
            books.prefill_s -= req.prefill_s
        if not books.active:  # nothing left: no float residue either
            books.prefill = books.decode = books.prefill_s = 0.0
        return req.worker

    def _dequeue(self, books: _Books, request_id: str) -> None:
        """Take a request off ``books``' prefill queue (or its fetches); a head leaves the
        blocks stored beyond its own to the next head (its first chunk, computed in the
        iteration that finished the head, came in the same events)."""
        if books.fetching.pop(request_id, None) is not None:
            self._prefilling -= 1
            return
        queue = books.queue
        head = next(iter(queue), None) == request_id
        req = queue.pop(request_id, None)
        if req is not None:
            self._prefilling -= 1
        if not queue:
            books.progress = 0
        elif head:
            assert req is not None
            left = books.progress - int(req.prefill_blocks)
            books.progress = left if left > 0 else 0

    def stored(self, worker: int, blocks: int) -> None:
        """``worker`` stored ``blocks`` device blocks (its KV events): its head prefill's
        progress. Chunked prefill gives the oldest prefilling request its chunk first, so
        they are counted as the head's."""
        books = self._books.get(worker)
        if books is not None and books.queue:
            books.progress += blocks

    def _head_done(self, books: _Books) -> float:
        p = books.progress
        if not p:
            return 0.0
        head = next(iter(books.queue.values()))
        if p >= head.prefill_blocks:
            return head.prefill_s
        done = p * (head.lin + head.quad * p)
        return done if done < head.prefill_s else head.prefill_s

    def reported(self, worker: int, load: ReportedLoad) -> None:
        """Fold in the worker's own report of its load."""
        books = self._books.get(worker)
        if books is None:
            return
        books.report = load
        books.external_active = max(0, load.running + load.waiting - books.active)
        if books.external_active == 0:
            # Every request there is ours. Its phase may differ between our books and the
            # worker's (a non-streamed answer shows no first token until it ends), so a
            # per-phase difference is not foreign load: count none.
            books.external_prefill = books.external_decode = 0.0
        else:
            books.external_prefill = max(0.0, load.pending_prefill_blocks - books.prefill)
            books.external_decode = max(0.0, load.decode_blocks - books.decode)

    def load(self, worker: int) -> WorkerLoad:
        """The load to weigh for ``worker`` (zero for an unknown worker)."""
        books = self._books.get(worker)
        if books is None:
            return WorkerLoad(0, 0.0, 0.0)
        return WorkerLoad(books.active + books.external_active,
                          max(0.0, books.prefill) + books.external_prefill,
                          max(0.0, books.decode) + books.external_decode,
                          max(0.0, books.prefill_s - self._head_done(books)),
                          books.external_prefill, len(books.queue) + len(books.fetching))

    def figures(self, worker: int) -> tuple[int, float, float, float, float, int]:
        """:meth:`load`'s figures as a plain tuple, in its fields' order (active requests,
        pending prefill blocks, decode blocks, pending prefill seconds, foreign prefill
        blocks, requests prefilling): the routing core regroups a worker with them twice a
        request, and a frozen dataclass costs a call per field to build."""
        books = self._books.get(worker)
        if books is None:
            return 0, 0.0, 0.0, 0.0, 0.0, 0
        prefill, decode = books.prefill, books.decode
        prefill_s = books.prefill_s - self._head_done(books) if books.progress else books.prefill_s
        return (books.active + books.external_active,
                (prefill if prefill > 0.0 else 0.0) + books.external_prefill,
                (decode if decode > 0.0 else 0.0) + books.external_decode,
                prefill_s if prefill_s > 0.0 else 0.0, books.external_prefill,
                len(books.queue) + len(books.fetching))

    def prefilling(self) -> int:
        """Our requests that have not given their first token yet, over every worker."""
        return self._prefilling

    def last_report(self, worker: int) -> ReportedLoad | None:
        """The load ``worker`` reported last (None before its first report)."""
        books = self._books.get(worker)
        return None if books is None else books.report

    def in_flight(self, worker: int) -> int:
        """Requests this router has in flight on ``worker``."""
        books = self._books.get(worker)
        return 0 if books is None else books.active
