"""One registered worker as the registry keeps it (:class:`WorkerEntry`), the candidates a
decision may pick (:data:`Target`: a worker, or one data-parallel rank of it), and what the
registry reads of the router's settings (:class:`FleetSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.events.feed import EventFeed
from router.events.transport import EventTransport
from router.fleet.engines import EngineAdapter, adapter_for
from router.fleet.first_byte_waits import FirstByteWaits
from router.fleet.liveness import Liveness
from router.fleet.ranks import WorkerRank
from router.fleet.worker_config import WorkerConfig
from router.fleet.worker_table import WorkerInfo, WorkerState

__all__ = ["FleetSettings", "Target", "WorkerEntry"]


@dataclass(slots=True)
class WorkerEntry:
    """One registered worker."""

    id: int
    url: str
    state: WorkerState = WorkerState.UNHEALTHY
    info: WorkerInfo | None = None
    feed: EventFeed | None = None
    unhealthy_since: float | None = None
    last_error: str | None = None
    indexed: bool = False
    counters: dict[str, float] = field(default_factory=dict)
    #: Requests sent here still waiting for their first byte (given up when it turns unhealthy).
    waits: FirstByteWaits = field(default_factory=FirstByteWaits)
    config: WorkerConfig | None = None
    #: Set once unregistered: a check still in flight for it must subscribe to nothing.
    removed: bool = False
    #: The last change a poll found in what the worker serves (``GET /workers``).
    last_change: str | None = None
    #: Evidence of life from late probes and the data path.
    liveness: Liveness = field(default_factory=Liveness)
    #: The cause last logged for its not being a candidate (each is logged once).
    said: str | None = None
    #: Ranks 1 and up of a data-parallel worker (:mod:`router.fleet.ranks`); rank 0 is this
    #: entry. Empty for a worker of one rank.
    extra_ranks: list[WorkerRank] = field(default_factory=list)
    #: Ranks 1 and up's own feeds, for an engine that publishes one stream per rank (vLLM).
    rank_feeds: list[EventFeed] = field(default_factory=list)

    @property
    def feeds(self) -> list[EventFeed]:
        """Every event feed of this worker: its own, then its ranks' own ones."""
        return ([self.feed] if self.feed is not None else []) + self.rank_feeds

    @property
    def stream_per_rank(self) -> bool:
        """Whether each rank publishes on a stream of its own (stock engines: vLLM's rank r
        on port + r) rather than all on one (kvroute's worker)."""
        return self.engine != "kvroute" and bool(self.extra_ranks)

    @property
    def rank(self) -> int | None:
        """This entry's data-parallel rank: 0 on a worker of several ranks, else None (no
        rank to pin)."""
        return 0 if self.extra_ranks else None

    @property
    def worker(self) -> WorkerEntry:
        """The worker this candidate belongs to (itself: it is rank 0)."""
        return self

    @property
    def targets(self) -> list[Target]:
        """Every rank of this worker as a routing candidate, rank 0 (this entry) first."""
        return [self, *self.extra_ranks]

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks this worker serves: the configured number, else the
        one its engine reports, else 1."""
        if self.config is not None and self.config.dp_size is not None:
            return self.config.dp_size
        return self.info.data_parallel_size if self.info is not None else 1

    @property
    def role(self) -> str:
        """``both``, ``prefill`` or ``decode`` (:mod:`router.fleet.worker_config`)."""
        return self.config.role if self.config else "both"

    @property
    def engine(self) -> str:
        """The worker's engine (a worker registered by URL alone is kvroute's)."""
        return self.config.engine if self.config else "kvroute"

    @property
    def adapter(self) -> EngineAdapter:
        """How this worker's engine is asked who it is and how loaded."""
        return adapter_for(self.engine)

    @property
    def worker_config(self) -> WorkerConfig:
        """The worker's configuration (engine, event endpoints)."""
        return self.config or WorkerConfig(self.url)

    @property
    def approximate(self) -> bool:
        """True when the worker publishes no events: routing history is all we know."""
        return self.info is not None and self.info.events_endpoint is None

    def describe(self) -> dict[str, Any]:
        """The JSON shape of ``GET /workers``."""
        info = self.info
        return {
            "id": self.id, "url": self.url, "state": self.state.value,
            "instance_id": info.instance_id if info else None,
            "model": info.model if info else None,
            "events": info.events_endpoint if info else None,
            "approximate": self.approximate, "last_error": self.last_error,
            "last_change": self.last_change,
            "resyncing": bool(self.feed and self.feed.resyncing),
            "counters": dict(self.counters),
            "engine": self.engine,
            # How lost event history is recovered: from the worker's snapshot, or by
            # dropping its entries and learning them again from the stream.
            "resync": "snapshot" if info and info.snapshot else "clear_and_relearn",
            "role": self.role,
            "dp_size": len(self.targets),
            "ranks": [{"rank": 0, "id": self.id}, *(r.describe() for r in self.extra_ranks)]
            if self.extra_ranks else [],
        }


#: A routing candidate: a worker (its rank 0) or one of its other data-parallel ranks.
Target = WorkerEntry | WorkerRank


@dataclass(frozen=True)
class FleetSettings:
    """What the registry reads of the router's settings (``RouterSettings.fleet_settings``)."""

    #: Each worker in its flat text form (:mod:`router.fleet.worker_config`).
    workers: tuple[str, ...] = ()
    #: DNS targets to discover workers from, and how often to look.
    discover: tuple[str, ...] = ()
    discover_interval: float = 5.0
    block_size: int = 32
    health_interval: float = 1.0
    health_timeout: float = 1.0
    #: Late polls in a row, with no bytes on the data path, that take a worker out.
    health_misses: int = 2
    unhealthy_grace: float = 5.0
    #: The bearer token sent on the workers' admin calls (snapshots).
    worker_admin_token: str | None = None
    #: The event sockets' limits and CURVE keys.
    event_transport: EventTransport = field(default_factory=EventTransport)
