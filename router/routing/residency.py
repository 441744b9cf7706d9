"""Blocks the router believes a worker holds without an event saying so yet.

Two uses, one structure:

- Predict-on-route: when a request is sent to w, its prompt blocks count as resident on w for
  ``ttl`` seconds (ten by default: near saturation a request can wait seconds before its
  blocks are stored), or until w's first events after its first token (:meth:`settle`: its
  prompt is stored, the events say so, and the index knows from then on, evictions included). So a
  burst of siblings sharing a new prefix lands together instead of spreading before the first
  one's events arrive.
- Approximate mode, for workers that publish no events: the same record with a long ``ttl``
  (minutes, as SGLang's gateway does) and a bound on entries, learned from routing alone.

Pure: the caller passes ``now``. Matching extends the index's leading run: blocks past the run
the index reports count only while they are predicted here too. :meth:`holders` names the
workers a prompt's first block is predicted on without asking each worker, so the routing core
prices only the workers that may hold some of a prompt.

This class is the specification; the routing core builds :data:`Residency`, the compiled twin
(``native/_residency.pyx``) when it is built, as the index does (:mod:`indexer.index`).
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

__all__ = ["PredictedResidency", "Residency"]


class PredictedResidency:
    """Per worker, local block hashes with an expiry time; bounded, oldest dropped first.

    Args:
        ttl: seconds a prediction lives.
        max_blocks: bound on entries per worker; the oldest go first.
    """

    def __init__(self, ttl: float, max_blocks: int = 1 << 20) -> None:
        if ttl <= 0 or max_blocks <= 0:
            raise ValueError("ttl and max_blocks must be positive")
        self.ttl = ttl
        self.max_blocks = max_blocks
        self._by_worker: dict[int, OrderedDict[int, float]] = {}
        # A routed prompt's first block -> the workers it was predicted on (a superset: an
        # entry goes when its prediction is dropped, and holders() checks the expiry).
        self._first: dict[int, set[int]] = {}
        # (expiry, worker) per prediction made, in expiry order: expire() visits only the
        # workers with something due, not the fleet.
        self._due: deque[tuple[float, int]] = deque()

    def predict(self, worker: int, hashes: Sequence[int], now: float) -> None:
        """Record that ``worker`` holds ``hashes`` as of ``now``."""
        if not hashes:
            return
        entries = self._by_worker.setdefault(worker, OrderedDict())
        expiry = now + self.ttl
        for h in hashes:
            entries[h] = expiry
            entries.move_to_end(h)
        self._first.setdefault(hashes[0], set()).add(worker)
        self._due.append((expiry, worker))
        while len(entries) > self.max_blocks:
            self._dropped(worker, entries.popitem(last=False)[0])

    def _dropped(self, worker: int, block: int) -> None:
        workers = self._first.get(block)
        if workers is not None:
            workers.discard(worker)
            if not workers:
                del self._first[block]

    def holders(self, first: int, now: float) -> list[int]:
        """Workers on which a prompt whose first block is ``first`` is predicted at ``now``
        (every worker :meth:`extend` would extend from 0 for such a prompt)."""
        workers = self._first.get(first)
        if not workers:
            return []
        out = []
        for w in workers:
            entries = self._by_worker.get(w)
            expiry = entries.get(first) if entries else None
            if expiry is not None and expiry > now:
                out.append(w)
        return out

    def extend(self, worker: int, hashes: Sequence[int], start: int, now: float) -> int:
        """Return how far the leading run of ``hashes`` reaches on ``worker``, continuing from
        ``start`` blocks already known resident."""
        entries = self._by_worker.get(worker)
        if not entries:
            return start
        n = start
        get = entries.get  # bound once: half the time of a lookup through the OrderedDict
        for h in hashes[start:]:
            if get(h, 0.0) <= now:  # absent, or expired
                break
            n += 1
        return n

    def workers(self) -> list[int]:
        """Workers with any prediction recorded."""
        return [w for w, e in self._by_worker.items() if e]

    def forget(self, worker: int) -> None:
        """Drop every prediction for ``worker`` (cleared, restarted, removed)."""
        entries = self._by_worker.pop(worker, None)
        if entries:
            for block in [b for b, ws in self._first.items() if worker in ws]:
                self._dropped(worker, block)

    def withdraw(self, worker: int, hashes: Sequence[int]) -> None:
        """Drop the predictions of ``hashes`` on ``worker`` (it refused the request that made
        them; a sibling's prediction of the same blocks goes too)."""
        entries = self._by_worker.get(worker)
        if entries:
            for h in hashes:
                if entries.pop(h, None) is not None:
                    self._dropped(worker, h)

    def settle(self, worker: int, hashes: Sequence[int], until: float) -> None:
        """End the predictions of ``hashes`` on ``worker`` at ``until`` at the latest: the
        request that made them has computed its prompt there, and the worker's events will
        say so (and later say if the blocks are evicted). A sibling's prediction of the same
        blocks ends with it: they are the same blocks. Expired entries may then sit behind
        unexpired ones until those expire; :meth:`extend` and :meth:`holders` read each
        entry's own expiry, and ``max_blocks`` bounds them."""
        entries = self._by_worker.get(worker)
        if not entries:
            return
        for h in hashes:
            expiry = entries.get(h)
            if expiry is not None and expiry > until:
                entries[h] = until

    def expire(self, now: float) -> int:
        """Drop expired predictions; returns how many went.

        Cheap enough to call per request: every prediction lives the same ``ttl`` and
        :meth:`predict` moves each to the end, so each worker's entries are in expiry order
        and only the expired ones at the front are looked at, on the workers a prediction
        came due on (``now`` never decreasing from call to call).
        """
        dropped = 0
        due = self._due
        while due and due[0][0] <= now:
            worker = due.popleft()[1]
            entries = self._by_worker.get(worker)
            if entries is None:
                continue
            while entries:
                h, expiry = next(iter(entries.items()))
                if expiry > now:
                    break
                del entries[h]
                self._dropped(worker, h)
                dropped += 1
            if not entries:
                del self._by_worker[worker]
        return dropped

    def size(self, worker: int) -> int:
        """Predictions held for ``worker`` (expired ones included until :meth:`expire`)."""
        return len(self._by_worker.get(worker, ()))



def _compiled() -> type[PredictedResidency]:
    """The class the routing core uses: the compiled twin (``native/_residency.pyx``, the
    same names and results, no Python object per block) unless ``KVROUTE_PURE_PYTHON`` is
    set or it is not built (then this one, the specification). Type checkers read this one."""
    if TYPE_CHECKING or os.environ.get("KVROUTE_PURE_PYTHON", "") not in ("", "0"):
        return PredictedResidency
    try:
        from native._residency import PredictedResidency as compiled  # type: ignore[import-not-found]
    except ImportError as exc:
        warnings.warn(f"kvroute's compiled residency is not built ({exc}); using the "
                      "pure-Python one. Rebuild with `pip install -e .`.", RuntimeWarning,
                      stacklevel=2)
        return PredictedResidency
    return compiled  # type: ignore[no-any-return]


#: :class:`PredictedResidency` as the routing core builds it (:func:`_compiled`).
Residency = _compiled()
