"""The ``worker`` label of the request-path metrics: a worker's id, with a bound.

A Prometheus client keeps every label value it ever saw until told to forget it. Worker ids
only grow (a worker that discovery drops and finds again gets a new one), so the families
recorded on the request path drop a worker's series once it is unregistered
(:meth:`WorkerLabels.prune`, at scrape time), and beyond :data:`MAX_WORKER_LABELS` live workers
the rest share the value ``other``. The id, not the URL, is the label: ``kvroute_upstream_info``
maps one to the other (a URL is long, and a pod's changes on every restart).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["MAX_WORKER_LABELS", "OTHER", "WorkerLabels"]

#: Live workers with a label value of their own.
MAX_WORKER_LABELS = 256
#: The value the workers past the bound share.
OTHER = "other"

T = TypeVar("T")


class WorkerLabels(Generic[T]):
    """Per-worker values (a bundle of labelled metric children), made on first use.

    Args:
        make: builds the value for a label (``"3"`` or ``"other"``).
        drop: forgets the series of a label no longer in use.
        limit: live workers with a label of their own.
    """

    def __init__(self, make: Callable[[str], T], drop: Callable[[str], None],
                 limit: int = MAX_WORKER_LABELS) -> None:
        self._make = make
        self._drop = drop
        self._limit = limit
        self._by_worker: dict[int, T] = {}
        self._shared: T | None = None

    def get(self, worker: int) -> T:
        """The value for ``worker``."""
        found = self._by_worker.get(worker)
        if found is not None:
            return found
        if len(self._by_worker) < self._limit:
            found = self._by_worker[worker] = self._make(str(worker))
            return found
        if self._shared is None:
            self._shared = self._make(OTHER)
        return self._shared

    def get_known(self, label: str) -> T | None:
        """The value made for ``label``, if any (without making one)."""
        if label == OTHER:
            return self._shared
        return self._by_worker.get(int(label))

    def prune(self, live: Iterable[int]) -> None:
        """Forget the workers not in ``live`` (unregistered), and their series."""
        keep = set(live)
        for worker in [w for w in self._by_worker if w not in keep]:
            self._drop(str(worker))
            del self._by_worker[worker]

    def __len__(self) -> int:
        return len(self._by_worker)
