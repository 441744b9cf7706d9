"""The registered workers that may take a request now, kept as a list between changes.

Every routing decision starts from the healthy workers in id order. Rebuilding that list per
request reads every entry's state: about 110 µs at 1,024 workers (``bench.router``), more than
the rest of the decision's routing work. Health and membership change a few times a minute at
most, so :class:`HealthyWorkers` builds the list once and the registry calls
:meth:`HealthyWorkers.changed` wherever a worker joins, leaves or changes state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar

from router.fleet.worker_table import WorkerState

__all__ = ["HealthyWorkers"]


class _Entry(Protocol):
    @property
    def state(self) -> WorkerState: ...


E = TypeVar("E", bound=_Entry)


class HealthyWorkers(Generic[E]):
    """The HEALTHY entries of ``entries``, in its (insertion, so id) order.

    Invariant: between two :meth:`changed` calls no entry joins, leaves or changes state; the
    owner of ``entries`` calls :meth:`changed` after every such change.

    Args:
        entries: the registry's entries by id (read, never changed).
    """

    def __init__(self, entries: Mapping[int, E]) -> None:
        self._entries = entries
        self._list: list[E] | None = None

    def changed(self) -> None:
        """A worker joined, left or changed state: the next :meth:`list` rebuilds."""
        self._list = None

    def list(self) -> list[E]:
        """The healthy entries. The same list object until the next :meth:`changed`, so a
        caller may compare by identity; shared, so callers must not change it."""
        found = self._list
        if found is None:
            found = self._list = [e for e in self._entries.values()
                                  if e.state is WorkerState.HEALTHY]
        return found
