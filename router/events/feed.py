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
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from indexer.decode import DecodeStats, MalformedBatch, decode_batch
from indexer.events import Batch, Cleared, Event
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

__all__ = ["EventFeed", "IndexLike", "SnapshotFetch"]

log = logging.getLogger(__name__)

SnapshotFetch = Callable[[], Awaitable[dict[str, Any]]]


class IndexLike(Protocol):
    def apply_batch(self, worker: int, events: list[Event]) -> None: ...
    def clear(self, worker: int) -> None: ...


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
    """

    def __init__(self, worker: int, index: IndexLike, endpoint: str, replay_endpoint: str | None,
                 *, fetch_snapshot: SnapshotFetch | None, on_cleared: Callable[[int], None],
                 counters: dict[str, float],
                 on_events: Callable[[int, list[Event]], None] | None = None,
                 transport: EventTransport | None = None) -> None:
        self.worker = worker
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

    def _apply(self, batch: Batch) -> None:
        try:
            self._index.apply_batch(self.worker, batch.events)
        except Exception:  # the index counts bad events itself; this is a last resort
            self._bump("apply_errors")
            log.exception("index rejected a batch from worker %d", self.worker)
        if self._on_events is not None:
            self._on_events(self.worker, batch.events)
        if any(isinstance(e, Cleared) for e in batch.events):
            self._on_cleared(self.worker)

    def _clear(self) -> None:
        self._index.clear(self.worker)
        self._on_cleared(self.worker)

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
