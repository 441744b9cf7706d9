# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The compiled predicted residency: the same class, methods and results as
:class:`router.routing.residency.PredictedResidency`, which specifies it.

Each worker's predictions are a C++ record (``residency_core.h``: block hash -> expiry in
prediction order), so a request's per-block loops (:meth:`predict` and :meth:`extend`, a
prompt's blocks each) run without a Python object or call per block. What is per request or
per worker (the first-block holders, the expiry queue) stays in Python containers built as
the specification builds them, so :meth:`holders` lists workers in the same order.

One difference, at the boundary: block hashes are ints in ``[0, 2**64)``, as the index's
are. :meth:`predict` refuses any other with a ``ValueError``; elsewhere such a value is a
block nothing predicted (as it would be in the specification, whose ``predict`` it never
passed).
"""

from collections import deque

from cpython.ref cimport PyObject
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_SIZE
from libc.stdint cimport uint64_t
from libcpp cimport bool as cbool
from libcpp.vector cimport vector

__all__ = ["PredictedResidency"]

cdef extern from "Python.h":
    PyObject **PySequence_Fast_ITEMS(object)

cdef extern from "hash64.h":
    int kv_u64(PyObject *o, uint64_t *out)
    object kv_pylong_u64(uint64_t v)

cdef extern from "residency_core.h" namespace "kvr":
    cdef cppclass Slot "kvr::Predictions::Slot":
        uint64_t first
        double second
    cdef cppclass Predictions:
        size_t size()
        double get(uint64_t h)
        cbool find(uint64_t h, double *out)
        void set(uint64_t h, double expiry) except +
        void lower(uint64_t h, double until)
        cbool erase(uint64_t h)
        Slot front()
        void pop_front()


cdef class _Entries:
    """One worker's predictions."""
    cdef Predictions p


cdef class PredictedResidency:
    """Per worker, local block hashes with an expiry time; bounded, oldest dropped first.

    Args:
        ttl: seconds a prediction lives.
        max_blocks: bound on entries per worker; the oldest go first.
    """

    cdef public object ttl
    cdef public object max_blocks
    cdef double _ttl
    cdef Py_ssize_t _max
    cdef dict _by_worker
    cdef dict _first
    cdef object _due

    def __init__(self, ttl, max_blocks=1 << 20):
        if ttl <= 0 or max_blocks <= 0:
            raise ValueError("ttl and max_blocks must be positive")
        self.ttl = ttl
        self.max_blocks = max_blocks
        self._ttl = ttl
        self._max = max_blocks
        self._by_worker = {}
        self._first = {}
        self._due = deque()

    def predict(self, worker, hashes, double now):
        """Record that ``worker`` holds ``hashes`` as of ``now``.

        Raises:
            ValueError: a hash is not an int in ``[0, 2**64)`` (nothing is recorded).
        """
        if not hashes:
            return
        seq = PySequence_Fast(hashes, "hashes must be a sequence")
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i
        cdef PyObject **items = PySequence_Fast_ITEMS(seq)
        cdef vector[uint64_t] words
        words.resize(n)
        for i in range(n):
            if not kv_u64(items[i], &words[i]):
                raise ValueError("a block hash must be an int in [0, 2**64), not "
                                 f"{<object>items[i]!r}")
        cdef _Entries entries = self._by_worker.get(worker)
        if entries is None:
            entries = self._by_worker[worker] = _Entries()
        cdef double expiry = now + self._ttl
        for i in range(n):
            entries.p.set(words[i], expiry)
        first = <object>items[0]
        workers = self._first.get(first)
        if workers is None:
            workers = self._first[first] = set()
        workers.add(worker)
        self._due.append((expiry, worker))
        while <Py_ssize_t>entries.p.size() > self._max:
            block = entries.p.front().first
            entries.p.pop_front()
            self._dropped(worker, kv_pylong_u64(block))

    cdef _dropped(self, worker, block):
        workers = self._first.get(block)
        if workers is not None:
            workers.discard(worker)
            if not workers:
                del self._first[block]

    def holders(self, first, double now):
        """Workers on which a prompt whose first block is ``first`` is predicted at ``now``
        (every worker :meth:`extend` would extend from 0 for such a prompt)."""
        workers = self._first.get(first)
        if not workers:
            return []
        cdef uint64_t h
        cdef double expiry
        if not kv_u64(<PyObject *>first, &h):
            return []
        out = []
        for w in workers:
            entries = self._by_worker.get(w)
            if (entries is not None and (<_Entries>entries).p.find(h, &expiry)
                    and expiry > now):
                out.append(w)
        return out

    def extend(self, worker, hashes, Py_ssize_t start, double now):
        """Return how far the leading run of ``hashes`` reaches on ``worker``, continuing from
        ``start`` blocks already known resident."""
        entries = self._by_worker.get(worker)
        if entries is None or (<_Entries>entries).p.size() == 0:
            return start
        cdef Predictions *p = &(<_Entries>entries).p
        seq = PySequence_Fast(hashes, "hashes must be a sequence")
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        cdef PyObject **items = PySequence_Fast_ITEMS(seq)
        # As the specification's walk over hashes[start:] (a negative start counts from the end).
        cdef Py_ssize_t i = start if start >= 0 else max(n + start, 0)
        cdef Py_ssize_t run = start
        cdef uint64_t h
        while i < n:
            if not kv_u64(items[i], &h) or p.get(h) <= now:  # absent, or expired
                break
            run += 1
            i += 1
        return run

    def workers(self):
        """Workers with any prediction recorded."""
        return [w for w, e in self._by_worker.items() if (<_Entries>e).p.size()]

    def forget(self, worker):
        """Drop every prediction for ``worker`` (cleared, restarted, removed)."""
        entries = self._by_worker.pop(worker, None)
        if entries is not None and (<_Entries>entries).p.size():
            for block in [b for b, ws in self._first.items() if worker in ws]:
                self._dropped(worker, block)

    def withdraw(self, worker, hashes):
        """Drop the predictions of ``hashes`` on ``worker`` (it refused the request that made
        them; a sibling's prediction of the same blocks goes too)."""
        entries = self._by_worker.get(worker)
        if entries is None or not (<_Entries>entries).p.size():
            return
        cdef Predictions *p = &(<_Entries>entries).p
        cdef uint64_t h
        for block in hashes:
            if kv_u64(<PyObject *>block, &h) and p.erase(h):
                self._dropped(worker, block)

    def settle(self, worker, hashes, double until):
        """End the predictions of ``hashes`` on ``worker`` at ``until`` at the latest (the
        specification says why and what it leaves)."""
        entries = self._by_worker.get(worker)
        if entries is None or not (<_Entries>entries).p.size():
            return
        cdef Predictions *p = &(<_Entries>entries).p
        cdef uint64_t h
        for block in hashes:
            if kv_u64(<PyObject *>block, &h):
                p.lower(h, until)

    def expire(self, double now):
        """Drop expired predictions; returns how many went (only the expired front of the
        workers a prediction came due on is looked at, as in the specification)."""
        cdef Py_ssize_t dropped = 0
        cdef Predictions *p
        cdef Slot front
        due = self._due
        while due and due[0][0] <= now:
            worker = due.popleft()[1]
            entries = self._by_worker.get(worker)
            if entries is None:
                continue
            p = &(<_Entries>entries).p
            while p.size():
                front = p.front()
                if front.second > now:
                    break
                p.pop_front()
                self._dropped(worker, kv_pylong_u64(front.first))
                dropped += 1
            if not p.size():
                del self._by_worker[worker]
        return dropped

    def size(self, worker):
        """Predictions held for ``worker`` (expired ones included until :meth:`expire`)."""
        entries = self._by_worker.get(worker)
        return 0 if entries is None else (<_Entries>entries).p.size()
