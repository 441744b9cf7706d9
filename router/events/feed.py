"""One worker's event stream feeding the index, in stream order, with resynchronisation.

What each subscriber notice does (``docs/design.md``, failure rules):

- ``Delivered``: apply the batch's events to the index for that worker (AllBlocksCleared
  clears in stream order, as one of the events). Lag = now - batch ``ts`` is recorded.
- ``HistoryLost``: the worker's entries can no longer be trusted. If the worker serves
  ``GET /kv/snapshot``, fetch it: clear the worker, apply the snapshot (which re-stores every
  resident block, parents first), then the batches that arrived meanwhile with a later seq.
  Otherwise clear the worker's entries (stale entries route wrongly; missing ones only cost a
  miss) and rebuild from the stream.
- ``Restarted``: a new engine instance: clear the worker's entries.
- ``GapDetected`` / ``MalformedInput``: counted.

A worker's view is bounded by the capacity it declared (``max_blocks``): stored events that
would take its entries, device and host tiers together, past the bound are skipped and their
blocks counted as ``over_capacity``. The registry sets the bound at
:data:`CAPACITY_SLACK` times the declared device plus host blocks, since a block may sit on
both tiers and events in flight lag behind evictions; a publisher that stores more than that
is buggy or not the worker, and what it adds costs the router a bounded amount.

A data-parallel worker (:mod:`router.fleet.ranks`) publishes every rank's events on one stream,
each batch naming its ``data_parallel_rank``: the feed applies a batch to its rank's id in the
index (``ranks``), and a clear, a restart or a lost history clears every rank. A worker of one
rank takes every batch whatever rank it names (a server started as rank 3 of a deployment run
one server per rank); a batch naming a rank the worker does not have is counted as
``unknown_rank`` and skipped. The capacity bound holds per rank.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from indexer.decode import DecodeStats, MalformedBatch, decode_batch
from indexer.events import Batch, Cleared, Event, Stored
from router.events.subscriber import (
    Delivered,
    EventSubscriber,
    GapDetected,
    HistoryLost,
    MalformedInput,
    Notice,
    Restarted,
)
from router.events.transport import EventTransport

__all__ = ["CAPACITY_SLACK", "EventFeed", "IndexLike", "SnapshotFetch"]

log = logging.getLogger(__name__)

SnapshotFetch = Callable[[], Awaitable[dict[str, Any]]]

#: A worker's entries are bounded at this many times its declared capacity (module docstring).
CAPACITY_SLACK = 2


class IndexLike(Protocol):
    def apply_batch(self, worker: int, events: list[Event]) -> None: ...
    def clear(self, worker: int) -> None: ...
    def worker_blocks(self, worker: int) -> tuple[int, int]: ...


class EventFeed:
    """Subscribes to one worker rank and keeps the index's view of it current.

    Args:
        worker: the worker's id in the index.
        index: the prefix index (shared by all feeds; the event loop serialises access).
        endpoint: the worker's PUB endpoint; replay_endpoint its replay ROUTER (or None).
        fetch_snapshot: coroutine returning the worker's ``/kv/snapshot`` JSON, or None when
            the worker has none.
        on_cleared: called with the worker id whenever its entries were dropped (so the
            router forgets predictions too).
        counters: a dict of counters to bump (``resyncs``, ``snapshots``, ...).
        on_events: called with the worker id and each batch's events once the index has
            applied them (the router's eviction-pressure tracker listens here).
        transport: the event sockets' size limits and CURVE keys (defaults: no CURVE).
        max_blocks: the most entries the worker may hold in the index, both tiers together
            (module docstring); ``None``: unbounded (no capacity declared).
        ranks: the index id of each data-parallel rank, rank 0 first (module docstring);
            ``None``: one rank, ``worker``.
    """

    def __init__(self, worker: int, index: IndexLike, endpoint: str, replay_endpoint: str | None,
                 *, fetch_snapshot: SnapshotFetch | None, on_cleared: Callable[[int], None],
                 counters: dict[str, float],
                 on_events: Callable[[int, list[Event]], None] | None = None,
                 transport: EventTransport | None = None,
                 max_blocks: int | None = None, ranks: list[int] | None = None) -> None:
        self.worker = worker
        #: The index id of each rank (the registry reshapes it when the worker's ranks change).
        self.ranks = ranks or [worker]
        self.max_blocks = max_blocks
        self._index = index
        self._on_events = on_events
        self._fetch = fetch_snapshot
        self._on_cleared = on_cleared
        self.counters = counters
        self._resync: asyncio.Task[None] | None = None
        self._held: list[tuple[int, Batch]] = []
        self.last_lag = 0.0
        self.subscriber = EventSubscriber(endpoint, self.on_notice,
                                          replay_endpoint=replay_endpoint,
                                          from_seq=0 if replay_endpoint else None,
                                          transport=transport)
        self.decode_stats: DecodeStats = self.subscriber.decode_stats

    async def start(self) -> None:
        """Connect; a worker with a replay buffer is caught up from its seq 0."""
        await self.subscriber.start()

    async def stop(self) -> None:
        """Stop the subscription and any resync in flight."""
        if self._resync is not None:
            self._resync.cancel()
            await asyncio.gather(self._resync, return_exceptions=True)
            self._resync = None
        await self.subscriber.stop()

    @property
    def failure(self) -> str | None:
        """Why this feed stopped following its stream (its subscriber's task ended), or None
        while it follows it."""
        return self.subscriber.failure

    @property
    def resyncing(self) -> bool:
        """Whether a snapshot fetch is in flight."""
        return self._resync is not None and not self._resync.done()

    def on_notice(self, notice: Notice) -> None:
        """Apply one subscriber notice (called in stream order)."""
        match notice:
            case Delivered(seq, batch, replayed):
                self._bump("batches")
                if replayed:
                    self._bump("replayed")
                self.last_lag = max(0.0, time.time() - batch.ts)
                if self.resyncing:
                    self._held.append((seq, batch))
                else:
                    self._apply(batch)
            case HistoryLost():
                self._bump("history_lost")
                self._start_resync()
            case Restarted():
                self._bump("restarts")
                self._clear()
            case GapDetected():
                self._bump("gaps")
            case MalformedInput():
                self._bump("malformed")

    def _target(self, batch: Batch) -> int | None:
        """The index id ``batch`` applies to, or None for a rank the worker does not have."""
        ranks = self.ranks
        if len(ranks) == 1:
            return ranks[0]
        rank = batch.data_parallel_rank or 0
        return ranks[rank] if 0 <= rank < len(ranks) else None

    def _apply(self, batch: Batch) -> None:
        target = self._target(batch)
        if target is None:
            if not self.counters.get("unknown_rank"):
                log.warning("worker %d: a batch of data-parallel rank %s, which it does not "
                            "have (%d ranks); skipped and counted", self.worker,
                            batch.data_parallel_rank, len(self.ranks))
            self._bump("unknown_rank")
            return
        events = batch.events
        if self.max_blocks is not None:
            events = self._within_capacity(target, events, self.max_blocks)
        try:
            self._index.apply_batch(target, events)
        except Exception:  # the index counts bad events itself; this is a last resort
            self._bump("apply_errors")
            log.exception("index rejected a batch from worker %d", target)
        if self._on_events is not None:
            self._on_events(target, events)
        if any(isinstance(e, Cleared) for e in events):
            self._on_cleared(target)

    def _within_capacity(self, target: int, events: list[Event], limit: int) -> list[Event]:
        """``events`` less the stored ones that would take ``target`` past ``limit``."""
        held = sum(self._index.worker_blocks(target))
        if held + sum(len(e.block_hashes) for e in events if isinstance(e, Stored)) <= limit:
            return events
        # Removals free room as the batch goes (an estimate: a removed block may not be
        # held); the next batch starts from the index's own count again.
        kept: list[Event] = []
        excess = 0
        for event in events:
            if isinstance(event, Stored):
                if held + len(event.block_hashes) > limit:
                    excess += len(event.block_hashes)
                    continue
                held += len(event.block_hashes)
            elif isinstance(event, Cleared):
                held = 0
            else:
                held = max(0, held - len(event.block_hashes))
            kept.append(event)
        if excess:
            if not self.counters.get("over_capacity"):
                log.warning("worker %d: its events would hold more than %d blocks; the "
                            "excess is skipped and counted", self.worker, limit)
            self.counters["over_capacity"] = self.counters.get("over_capacity", 0) + excess
        return kept

    def _clear(self) -> None:
        for target in self.ranks:
            self._index.clear(target)
            self._on_cleared(target)

    def _start_resync(self) -> None:
        self._bump("resyncs")
        if self._fetch is None:
            self._clear()
            return
        if self.resyncing:
            return
        self._held = []
        self._resync = asyncio.get_running_loop().create_task(self._resync_from_snapshot())

    async def _resync_from_snapshot(self) -> None:
        assert self._fetch is not None, "resync without a snapshot source"
        try:
            answer = await self._fetch()
            seq = int(answer["seq"])
            batch = decode_batch(base64.b64decode(answer["payload_b64"]))
        except (MalformedBatch, KeyError, ValueError, TypeError, OSError) as exc:
            self._bump("snapshot_failures")
            log.warning("worker %d: snapshot unusable (%s); clearing its entries",
                        self.worker, exc)
            self._clear()
            seq = -1
        except Exception as exc:  # network errors of any client: clear and rebuild
            self._bump("snapshot_failures")
            log.warning("worker %d: snapshot fetch failed (%s); clearing", self.worker, exc)
            self._clear()
            seq = -1
        else:
            self._bump("snapshots")
            self._clear()
            self._apply(batch)
        held, self._held = self._held, []
        for held_seq, held_batch in held:
            if held_seq > seq:
                self._apply(held_batch)

    def _bump(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1
