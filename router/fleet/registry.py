"""The worker registry: who the workers are, whether they are healthy, and their streams.

Workers come from settings (``--worker``, environment, config file) and the admin API, each
with an engine (:mod:`router.fleet.worker_config`). The registry asks the worker's engine adapter
(:mod:`router.fleet.engines`) who it is (for kvroute's worker, ``GET /model_info``), refuses an
incompatible one loudly, subscribes to its events (or, with no event endpoint, marks it
approximate: the index learns from routing decisions alone), and polls its health and load
through the adapter every ``health_interval`` seconds:

- a failed poll (a refused or reset connection, an error status, or an answer that is not a
  well-formed load report) takes the worker out of the candidate set at once, with the reason
  in ``last_error`` (``GET /workers``); when the worker did not answer at all, every request still
  waiting for its first byte there is given up and sent elsewhere
  (:class:`~router.fleet.first_byte_waits.FirstByteWaits`), so a hung worker costs them a few
  probe timeouts, not the proxy's first-byte ceiling;
- a poll with no answer within ``health_timeout`` is late, not failed: a busy worker queues its
  probe behind its streams. It is excused when the data path received bytes from the worker
  while the probe waited (within ``health_timeout`` seconds), and takes the worker out only
  after ``health_misses`` late polls in a row with no such evidence (:mod:`router.fleet.liveness`;
  ``late_probes`` and ``late_probes_excused`` in its counters);
- after ``unhealthy_grace`` seconds unhealthy, its index entries go too (they would only
  attract requests to a worker that cannot serve them), and its subscription stops;
- when it answers again, it is described anew: a new ``instance_id`` means a restart, so its
  entries are cleared and it is subscribed afresh (stock engines have none: their restarts
  show on the event stream);
- a configured worker that is not up yet is retried on every poll (compose starts the router
  and workers together);
- a poll that finds the worker serving another model (a stock engine restarted behind the same
  address) updates its description and the model table, with the reason in ``last_change``;
- a worker whose event subscription stopped (:attr:`EventFeed.failure`) is unhealthy with that
  reason, its entries dropped, and is subscribed afresh on the next check that it answers.

One round of polling is :meth:`Registry.poll_once`: it starts a check of every worker whose
previous check has ended and waits for them all; the loop started by :meth:`Registry.start`
starts the same round every ``health_interval`` without waiting, so a worker slow to answer
delays no other worker's check. Times (how long a worker has been unhealthy) are read from the
registry's ``clock``, so a test drives the grace with rounds and a clock of its own.

Every answer is untrusted input, parsed by the adapter (kvroute's worker by
:mod:`router.fleet.worker_answers`, stock engines by :mod:`router.fleet.engines.stock`).
Whatever goes wrong
with one worker (a malformed answer, or any exception at all) marks that worker unhealthy with
the reason; the poll loop itself never ends but by :meth:`Registry.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from router.events.feed import CAPACITY_SLACK, EventFeed, IndexLike
from router.fleet.discovery import Discovery
from router.fleet.engines import (
    PollFailed,
    WorkerChanged,
    WorkerUnreachable,
)
from router.fleet.entry import FleetSettings, Target, WorkerEntry
from router.fleet.facts import FleetFacts
from router.fleet.healthy import HealthyWorkers
from router.fleet.liveness import Liveness, Verdict
from router.fleet.ranks import WorkerRank, rank_endpoint
from router.fleet.unavailable import NO_WORKER_CONFIGURED, cause_of
from router.fleet.worker_config import WorkerConfig, parse_worker, parse_workers
from router.fleet.worker_table import IncompatibleWorker, WorkerInfo, WorkerState

__all__ = ["FleetSettings", "Registry", "Target", "WorkerEntry", "WorkerUnreachable"]

log = logging.getLogger(__name__)


class Registry:
    """Registered workers, their health and their event feeds.

    Args:
        settings: the fleet's settings.
        index: the prefix index the feeds apply events to.
        facts: told each fact about the workers as it happens (:mod:`router.fleet.facts`).
        tokenizer_identity: the router's tokenizer identity; workers must match it.
        http: the client for control calls (model info, load, snapshots).
        clock: seconds on any monotonic origin (``time.monotonic``; a test passes its own).
    """

    def __init__(self, settings: FleetSettings, index: IndexLike, facts: FleetFacts,
                 tokenizer_identity: str, http: httpx.AsyncClient,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._event_transport = settings.event_transport
        self._index = index
        self._facts = facts
        self._tokenizer = tokenizer_identity
        self._http = http
        self._entries: dict[int, WorkerEntry] = {}
        # Every join, leave and state change below calls self._healthy.changed().
        self._healthy = HealthyWorkers(self._entries)
        # Ranks 1 and up by candidate id, and the candidates as last expanded from the
        # healthy list (the same list object until the healthy list changes).
        self._ranks: dict[int, WorkerRank] = {}
        self._expanded_from: list[WorkerEntry] | None = None
        self._expanded: list[Target] = []
        self._next_id = 0
        self._poll: asyncio.Task[None] | None = None
        self._checks: dict[int, asyncio.Task[None]] = {}  # each worker's check in flight
        self.mm_tokens_per_image: int | None = None
        #: Workers found by DNS (``settings.discover``), from :meth:`start` on.
        self.discovery: Discovery | None = None

    # -- membership -------------------------------------------------------------------------

    def entries(self) -> list[WorkerEntry]:
        """Every registered worker, in id order."""
        return [self._entries[k] for k in sorted(self._entries)]

    def get(self, worker: int) -> WorkerEntry | None:
        """The entry with id ``worker``, if registered."""
        return self._entries.get(worker)

    def target(self, candidate: int) -> Target | None:
        """The worker or data-parallel rank with candidate id ``candidate``, if registered."""
        return self._entries.get(candidate) or self._ranks.get(candidate)

    def find(self, url: str) -> WorkerEntry | None:
        """The entry for ``url``, if registered."""
        url = url.rstrip("/")
        return next((e for e in self._entries.values() if e.url == url), None)

    def healthy(self) -> list[WorkerEntry]:
        """The healthy workers (not their ranks), in id order; shared, do not change it."""
        return self._healthy.list()

    def candidates(self) -> list[Target]:
        """Workers that may take a request now, each rank of a data-parallel worker after the
        worker, in id order of the workers (the order of insertion: ids only grow), kept
        between changes (:mod:`router.fleet.healthy`): shared, do not change it."""
        healthy = self._healthy.list()
        if healthy is not self._expanded_from:
            self._expanded_from = healthy
            self._expanded = ([t for e in healthy for t in e.targets]
                              if any(e.extra_ranks for e in healthy) else list(healthy))
        return self._expanded

    async def add(self, worker: str | WorkerConfig, *, must_answer: bool = True
                  ) -> WorkerEntry:
        """Register a worker and connect to it.

        Args:
            worker: the worker's base URL (a kvroute worker), or its configuration.
            must_answer: raise when the worker does not answer (admin API); otherwise keep
                it registered as unhealthy and retry on every poll (configured workers).

        Raises:
            ValueError: ``url`` is not an http(s) URL or is registered already.
            IncompatibleWorker: its block size, tokenizer or image tokens differ.
            WorkerUnreachable: it did not answer and ``must_answer`` is set.
        """
        config = parse_worker({"url": worker} if isinstance(worker, str) else worker)
        url = config.url
        if self.find(url) is not None:
            raise ValueError(f"worker {url} is registered already")
        entry = WorkerEntry(self._next_id, url, unhealthy_since=self._clock(), config=config,
                            liveness=self._liveness())
        self._next_id += 1  # before connecting: its ranks' ids come after it
        try:
            await self._connect(entry)
        except WorkerUnreachable as exc:
            _count_oversize(entry, exc)
            if must_answer:
                raise
            self._unreachable(entry, str(exc))
        except BaseException:
            self._shape_ranks(entry, 1)
            raise
        self._entries[entry.id] = entry
        self._healthy.changed()
        self._facts.joined(entry.id, entry.engine, entry.info)
        return entry

    def adopt(self, info: WorkerInfo) -> WorkerEntry:
        """Register a healthy worker whose model info is already known, without connecting
        to it or subscribing to its events (benchmarks and simulations drive the index)."""
        entry = WorkerEntry(self._next_id, info.url, WorkerState.HEALTHY, info, indexed=True,
                            liveness=self._liveness())
        self._next_id += 1
        self._entries[entry.id] = entry
        self._healthy.changed()
        self._facts.joined(entry.id, entry.engine, info)
        return entry

    def _liveness(self) -> Liveness:
        s = self._settings
        return Liveness(s.health_misses, s.health_timeout, self._clock)

    async def remove(self, worker: int) -> WorkerEntry:
        """Unregister a worker: stop its feed and drop its entries and load.

        Raises:
            KeyError: no such worker.
        """
        entry = self._entries.pop(worker)
        entry.removed = True
        self._healthy.changed()
        self._shape_ranks(entry, 1)
        await self._disconnect(entry)
        self._facts.left(worker)
        return entry

    def _shape_ranks(self, entry: WorkerEntry, size: int) -> None:
        """Give ``entry`` ``size`` data-parallel ranks: new ranks get fresh ids and books;
        dropped ones leave the index, the books and the core. The caller calls
        ``self._healthy.changed()``."""
        while len(entry.extra_ranks) > size - 1:
            rank = entry.extra_ranks.pop()
            del self._ranks[rank.id]
            self._index.clear(rank.id)
            if hasattr(self._index, "remove_worker"):
                self._index.remove_worker(rank.id)
            self._facts.left(rank.id)
        while len(entry.extra_ranks) < size - 1:
            rank = WorkerRank(self._next_id, len(entry.extra_ranks) + 1, entry)
            self._next_id += 1
            entry.extra_ranks.append(rank)
            self._ranks[rank.id] = rank
            self._facts.joined(rank.id, entry.engine, entry.info)
        if entry.feed is not None and not entry.stream_per_rank:
            entry.feed.ranks = [t.id for t in entry.targets]
        self._expanded_from = None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Register the configured workers (not-yet-up ones are retried) and start polling."""
        if not self._settings.workers and not self._settings.discover:
            log.warning("%s", NO_WORKER_CONFIGURED)
        for worker in parse_workers(list(self._settings.workers)):
            try:
                await self.add(worker, must_answer=False)
            except (IncompatibleWorker, ValueError) as exc:
                log.error("not routing to %s: %s", worker.url, exc)
        if self._settings.discover:
            self.discovery = Discovery(self._settings.discover,
                                       self._settings.discover_interval, self)
            await self.discovery.start()
        self._poll = asyncio.create_task(self._poll_forever(), name="kvroute-health")

    async def stop(self) -> None:
        """Stop polling, discovery and every feed."""
        if self.discovery is not None:
            await self.discovery.stop()
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
            self._poll = None
        checks, self._checks = list(self._checks.values()), {}
        for task in checks:
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)
        for entry in self._entries.values():
            feeds, entry.feed, entry.rank_feeds = entry.feeds, None, []
            for feed in feeds:
                await feed.stop()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._settings.health_interval)
            try:
                self._start_checks()
            except Exception:  # a bug here must not end failure detection for good
                log.exception("health poll round failed; polling goes on")

    async def poll_once(self) -> None:
        """One round of health polling: check every worker's load (a worker whose check from
        an earlier round still runs keeps that one), concurrently, and wait for every check.
        An exception while checking one worker marks that worker unhealthy and touches no
        other."""
        await asyncio.gather(*self._start_checks(), return_exceptions=True)

    def _start_checks(self) -> list[asyncio.Task[None]]:
        # Each worker's check is a task of its own, started unless its last one still runs.
        for worker in self._checks.keys() - self._entries.keys():
            self._checks.pop(worker).cancel()  # removed
        for entry in list(self._entries.values()):
            task = self._checks.get(entry.id)
            if task is None or task.done():
                self._checks[entry.id] = asyncio.create_task(
                    self._check_guarded(entry), name=f"kvroute-health-{entry.id}")
        return list(self._checks.values())

    async def _check_guarded(self, entry: WorkerEntry) -> None:
        try:
            await self._check(entry)
        except Exception as exc:
            log.error("checking worker %s failed", entry.url, exc_info=exc)
            if entry.removed:
                return
            try:
                await self._mark_unhealthy(
                    entry, f"health check failed: {type(exc).__name__}: {exc}")
            except Exception:
                log.exception("marking worker %s unhealthy failed", entry.url)

    # -- internals --------------------------------------------------------------------------

    async def _check(self, entry: WorkerEntry) -> None:
        if entry.state is WorkerState.INCOMPATIBLE:
            return
        failed = next((f.failure for f in entry.feeds if f.failure is not None), None)
        if failed is not None:
            # Its view can no longer follow the stream: drop it, and subscribe afresh once
            # the worker answers (the next check, from the unhealthy state).
            reason = failed
            entry.counters["feed_failures"] = entry.counters.get("feed_failures", 0) + 1
            await self._disconnect(entry)
            if not entry.removed:
                await self._mark_unhealthy(entry, reason)
            return
        try:
            load = await entry.adapter.poll(self._http, entry.worker_config, entry.info,
                                            self._settings.health_timeout)
        except PollFailed as exc:
            _count_oversize(entry, exc)
            if entry.removed:
                return
            reason = str(exc)
            if exc.late and entry.state is WorkerState.HEALTHY:
                verdict = entry.liveness.late()
                if verdict != "gone":
                    self._late(entry, verdict, reason)
                    return
                reason = (f"{reason} ({entry.liveness.misses} polls in a row, and no bytes "
                          "from it on the data path)")
            await self._mark_unhealthy(entry, reason, gone=exc.gone)
            return
        except WorkerChanged as exc:
            if entry.removed:
                return
            load = exc.load
            self._redescribed(entry, exc)
        if entry.removed:  # unregistered while its poll was answered
            return
        if entry.state is not WorkerState.HEALTHY:
            try:
                await self._connect(entry)
            except (WorkerUnreachable, IncompatibleWorker) as exc:
                _count_oversize(entry, exc)
                self._unreachable(entry, str(exc))
                return
        if not entry.removed:
            entry.liveness.answered()
            if not entry.extra_ranks:  # a data-parallel worker's report is of all its
                self._facts.reported(entry.id, load)  # ranks: the books go by routing alone

    def _late(self, entry: WorkerEntry, verdict: Verdict, reason: str) -> None:
        """A late poll that leaves ``entry`` healthy: excused by its data path, or a miss
        short of ``health_misses``."""
        name = "late_probes_excused" if verdict == "excused" else "late_probes"
        entry.counters[name] = entry.counters.get(name, 0) + 1
        if verdict == "missed":
            log.info("worker %s: %s (%d of %d misses)", entry.url, reason,
                     entry.liveness.misses, entry.liveness.misses_allowed)

    def _redescribed(self, entry: WorkerEntry, change: WorkerChanged) -> None:
        log.warning("worker %s: %s", entry.url, change)
        entry.info, entry.last_change = change.info, str(change)
        self._facts.described(entry.id, change.info)
        entry.counters["model_changes"] = entry.counters.get("model_changes", 0) + 1
        self._healthy.changed()  # the model table is built from the healthy list

    async def _mark_unhealthy(self, entry: WorkerEntry, reason: str, gone: bool = False
                              ) -> None:
        """Take ``entry`` out of the candidate set; ``gone``: it did not answer at all (hung,
        dead or unreachable), so requests waiting for its first byte are sent elsewhere."""
        now = self._clock()
        entry.counters["health_failures"] = entry.counters.get("health_failures", 0) + 1
        if entry.state is WorkerState.HEALTHY:
            log.warning("worker %s unhealthy: %s", entry.url, reason)
            entry.said = cause_of(reason)
            entry.state = WorkerState.UNHEALTHY
            self._healthy.changed()
            entry.unhealthy_since = now
        else:
            self._unreachable(entry, reason)
        given_up = entry.waits.give_up() if gone else 0
        if given_up:
            log.warning("worker %s: %d requests waiting for a first byte sent elsewhere",
                        entry.url, given_up)
        entry.last_error = reason
        since = entry.unhealthy_since or now
        if entry.indexed and now - since >= self._settings.unhealthy_grace:
            log.warning("worker %s unhealthy for %.1fs: dropping its index entries",
                        entry.url, now - since)
            await self._disconnect(entry)

    def _unreachable(self, entry: WorkerEntry, reason: str) -> None:
        """Note why ``entry`` is still no candidate, logging each new cause once."""
        entry.last_error = reason
        cause = cause_of(reason)
        if cause != entry.said and entry.state is not WorkerState.INCOMPATIBLE:
            entry.said = cause
            log.warning("worker %s is not available (%s): %s; retried every %gs", entry.url,
                        cause, reason, self._settings.health_interval)

    async def _connect(self, entry: WorkerEntry) -> None:
        # Each await below lets remove() run: an entry unregistered meanwhile is left alone
        # (remove() has stopped its feed and dropped its entries; nothing would stop a new one).
        info = await entry.adapter.describe(self._http, entry.worker_config,
                                            self._settings.block_size)
        if entry.removed:
            return
        try:
            # A stock engine names no tokenizer identity (it is "" then): nothing to compare.
            info.check_compatible(self._settings.block_size,
                                  self._tokenizer if info.tokenizer else None)
            self._check_images(info)
        except IncompatibleWorker as exc:
            entry.state, entry.last_error = WorkerState.INCOMPATIBLE, str(exc)
            self._healthy.changed()
            log.error("refusing worker: %s", exc)
            raise
        if entry.info is not None and entry.info.instance_id != info.instance_id:
            log.warning("worker %s restarted (instance %s -> %s): re-learning its cache",
                        entry.url, entry.info.instance_id, info.instance_id)
            entry.counters["restarts"] = entry.counters.get("restarts", 0) + 1
            await self._disconnect(entry)
            if entry.removed:
                return
        entry.info = info
        if entry.id in self._entries:  # else add() tells it with the join
            for target in entry.targets:
                self._facts.described(target.id, info)
        self._shape_ranks(entry, entry.dp_size)
        if self.mm_tokens_per_image is None and info.mm_tokens_per_image:
            self.mm_tokens_per_image = info.mm_tokens_per_image
        if entry.feed is None and info.events_endpoint is not None:
            fetch = self._snapshot_fetcher(entry.url) if info.snapshot else None
            feed = entry.feed = EventFeed(entry.id, self._index, info.events_endpoint,
                                          info.replay_endpoint, fetch_snapshot=fetch,
                                          on_cleared=self._cleared, counters=entry.counters,
                                          on_events=self._facts.events_applied,
                                          transport=self._event_transport,
                                          max_blocks=_max_blocks(info),
                                          ranks=[entry.id] if entry.stream_per_rank
                                          else [t.id for t in entry.targets])
            await feed.start()
            if entry.removed:  # removed while connecting: remove() may have stopped it mid-start
                entry.feed = None
                await feed.stop()
                return
            if entry.stream_per_rank and not entry.rank_feeds:
                await self._follow_ranks(entry, info, info.events_endpoint)
                if entry.removed:
                    return
        entry.indexed = True
        entry.state, entry.unhealthy_since, entry.last_error = WorkerState.HEALTHY, None, None
        entry.said = None
        self._healthy.changed()
        log.info("worker %s ready (instance %s)", entry.url, info.instance_id)

    async def _follow_ranks(self, entry: WorkerEntry, info: WorkerInfo, endpoint: str) -> None:
        """Subscribe to each of ranks 1 and up's own streams (:mod:`router.fleet.ranks`)."""
        for rank in entry.extra_ranks:
            assert rank.rank is not None, "a worker's rank beyond 0 has a number"
            replay = info.replay_endpoint
            feed = EventFeed(rank.id, self._index, rank_endpoint(endpoint, rank.rank),
                             rank_endpoint(replay, rank.rank) if replay else None,
                             fetch_snapshot=None, on_cleared=self._cleared,
                             counters=entry.counters, on_events=self._facts.events_applied,
                             transport=self._event_transport, max_blocks=_max_blocks(info))
            entry.rank_feeds.append(feed)
            await feed.start()
            if entry.removed:  # remove() stopped the feeds it saw; this one came after
                entry.rank_feeds = []
                await feed.stop()
                return

    def _check_images(self, info: WorkerInfo) -> None:
        known = self.mm_tokens_per_image
        if known is not None and info.mm_tokens_per_image and info.mm_tokens_per_image != known:
            raise IncompatibleWorker(
                f"worker {info.url} expands an image to {info.mm_tokens_per_image} tokens but "
                f"the other workers to {known}: image prompts would tokenize differently")

    def _snapshot_fetcher(self, url: str) -> Any:
        async def fetch() -> dict[str, Any]:
            response = await self._http.get(f"{url}/kv/snapshot", timeout=10.0,
                                            headers=self._admin_headers())
            response.raise_for_status()
            return response.json()  # type: ignore[no-any-return]
        return fetch

    def _admin_headers(self) -> dict[str, str]:
        token = self._settings.worker_admin_token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _cleared(self, worker: int) -> None:
        """``worker``'s entries were dropped: a fact for a registered worker (a removed one's
        leaving says it all)."""
        if worker in self._entries or worker in self._ranks:
            self._facts.cleared(worker)

    async def _disconnect(self, entry: WorkerEntry) -> None:
        feeds, entry.feed, entry.rank_feeds = entry.feeds, None, []
        for feed in feeds:
            await feed.stop()
        for target in entry.targets:
            self._index.clear(target.id)
            self._cleared(target.id)
            if hasattr(self._index, "remove_worker"):
                self._index.remove_worker(target.id)
        entry.indexed = False


def _count_oversize(entry: WorkerEntry, exc: Exception) -> None:
    """Count an answer refused for its size (``kvroute_control_answers_oversize``)."""
    if getattr(exc, "oversize", False):
        entry.counters["oversize_answers"] = entry.counters.get("oversize_answers", 0) + 1


def _max_blocks(info: WorkerInfo) -> int | None:
    """The bound on a worker's index entries (:mod:`router.events.feed`), None when it
    declares no capacity."""
    if not info.num_blocks:
        return None
    return CAPACITY_SLACK * (info.num_blocks + info.host_blocks)
