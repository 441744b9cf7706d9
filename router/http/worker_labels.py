"""The ``worker`` label of every per-worker metric family: a worker's id, with a bound.

A Prometheus client keeps every label value it ever saw until told to forget it, and a
dashboard pays for every series. Worker ids only grow (a worker that discovery drops and finds
again gets a new one), so a worker's label is given back once it is unregistered
(:meth:`WorkerLabels.prune`, at scrape time, which also drops the series recorded on the
request path), and beyond :data:`MAX_WORKER_LABELS` live workers the rest share the value
``other``. The families read from state at scrape time (:mod:`router.http.state_metrics`)
label through the same :meth:`WorkerLabels.label`, so one worker has one label everywhere. The
id, not the URL, is the label: ``kvroute_upstream_info`` maps one to the other (a URL is long,
and a pod's changes on every restart).
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
    """The ``worker`` label of each worker, and per-label values (a bundle of labelled metric
    children) made on first use.

    :meth:`label` is the one labelling every per-worker family uses, recorded on the request
    path or read from state at scrape time: a worker has its id while it holds one of ``limit``
    places (given on first use, kept until :meth:`prune`), and ``other`` otherwise.

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
        self._own: dict[int, str] = {}
        self._values: dict[str, T] = {}

    def label(self, worker: int) -> str:
        """``worker``'s label value: its id, or ``other`` while every place is taken."""
        found = self._own.get(worker)
        if found is not None:
            return found
        if len(self._own) < self._limit:
            found = self._own[worker] = str(worker)
            return found
        return OTHER

    def get(self, worker: int) -> T:
        """The value for ``worker``'s label."""
        label = self.label(worker)
        found = self._values.get(label)
        if found is None:
            found = self._values[label] = self._make(label)
        return found

    def get_known(self, label: str) -> T | None:
        """The value made for ``label``, if any (without making one)."""
        return self._values.get(label)

    def prune(self, live: Iterable[int]) -> None:
        """Forget the workers not in ``live`` (unregistered), and their series."""
        keep = set(live)
        for worker in [w for w in self._own if w not in keep]:
            label = self._own.pop(worker)
            if label in self._values:
                self._drop(label)
                del self._values[label]

    def __len__(self) -> int:
        """Workers with a label of their own."""
        return len(self._own)
