"""What the fleet tells whoever routes: the facts the registry and its feeds learn, as they
happen.

The registry and the event feeds call a :class:`FleetFacts` once per fact (a worker joined,
was described, left, had its cache cleared, reported its load, had events applied); they never
read anything back. The router's service hands in one that stamps each fact with the clock and
passes it down to the routing core (:class:`router.routing.core.RoutingCore`), so facts flow
down from the sockets to the pure core and nothing below calls back up. The base class ignores
every fact (a registry under test that routes nothing).
"""

from __future__ import annotations

from indexer.events import Event
from router.fleet.worker_table import WorkerInfo
from router.routing.load import ReportedLoad

__all__ = ["FleetFacts"]


class FleetFacts:
    """The facts a registry reports; each method ignores its fact here (module docstring)."""

    def joined(self, worker: int, engine: str, info: WorkerInfo | None) -> None:
        """``worker`` was registered; ``engine``: its kind (``kvroute``, ``vllm``, ...);
        ``info``: its model info, None while it has not answered."""

    def described(self, worker: int, info: WorkerInfo) -> None:
        """``worker``'s model info was read (again, after a reconnect or restart)."""

    def left(self, worker: int) -> None:
        """``worker`` was unregistered (its cache entries were dropped just before)."""

    def cleared(self, worker: int) -> None:
        """``worker``'s cache entries were dropped while it stays registered (restart, reset,
        or unhealthy past the grace period)."""

    def reported(self, worker: int, load: ReportedLoad) -> None:
        """``worker`` answered a health poll with its load."""

    def events_applied(self, worker: int, events: list[Event]) -> None:
        """A batch of ``worker``'s KV events was applied to the index."""
