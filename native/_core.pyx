# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The compiled prefix index and block hashing: the same names and results as
:mod:`indexer.hashing` and :mod:`indexer.radix`, which specify them.

The tables live in ``index_core.h`` and the hash in ``hash64.h``; this module turns Python
values into 64-bit words once per call and holds no Python object per block. Multimodal and
scoped root stores take the cold path through :func:`indexer.hashing.event_hash_input`, so
the rules for reading an event's scope and items are written once.
"""

from cython.operator cimport dereference as deref
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport PyObject
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_SIZE
from libc.stdint cimport uint32_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

import sys

from indexer.events import Cleared, Removed, Stored, tier_of
from indexer.hashing import UnhashableStore, event_hash_input
from indexer.radix import STAT_NAMES, warn_block_size_mismatch

__all__ = [
    "GLOBAL_SEED",
    "IMAGE_WORD",
    "PrefixIndex",
    "block_hashes",
    "identity_hash",
    "memory_floor_us",
    "scope_seed",
]

cdef extern from "Python.h":
    PyObject **PySequence_Fast_ITEMS(object)
    unsigned long long PyLong_AsUnsignedLongLong(object) except? -1

cdef extern from "hash64.h":
    uint64_t KV_GLOBAL_SEED
    uint64_t KV_IMAGE_WORD
    uint64_t KV_SCOPE_TAG
    uint64_t kv_finish(uint64_t prev, const uint64_t *w, size_t n)
    void kv_chain(uint64_t prev, const uint64_t *words, size_t blocks, size_t block_size,
                  uint64_t *out)
    uint64_t kv_identity_hash(const char *data, size_t length)
    int kv_chain_small(uint64_t prev, PyObject **items, size_t blocks, size_t block_size,
                       uint64_t *out)
    int kv_u64(PyObject *o, uint64_t *out)
    object kv_pylong_u64(uint64_t v)
    Py_ssize_t kv_token_words(PyObject **items, Py_ssize_t n, uint64_t *out, int *saw_str)

cdef extern from "index_core.h" namespace "kvr":
    double floor_reads_ns(size_t table_bytes, size_t reads, size_t rounds) except +
    cdef cppclass Entry:
        uint64_t key
        uint64_t local
        uint32_t tiers
    cdef cppclass Table[T]:
        T *a
        size_t cap
        size_t count
        T *find(uint64_t key)
    cdef cppclass Worker:
        uint32_t id
        Table[Entry] engine
        uint64_t blocks[2]
    cdef cppclass Result:
        uint32_t w
        uint32_t matched
        uint32_t device_matched
    cdef cppclass Index:
        Table[int] blocks  # only .count is read here
        vector[Worker *] workers
        uint32_t add_worker(uint32_t id) except +
        void drop_worker(uint32_t d) except +
        void store(uint32_t d, const uint64_t *eng, const uint64_t *loc, size_t n,
                   int tier) except +
        size_t remove(uint32_t d, const uint64_t *eng, size_t n, int tier) except +
        void set_direct(uint32_t d, const uint64_t *loc, size_t n, int tier,
                        cbool add) except +
        void clear(uint32_t d) except +
        void match(const uint64_t *q, size_t n, vector[Result] &out) except +
        size_t memory_bytes()

GLOBAL_SEED = KV_GLOBAL_SEED
IMAGE_WORD = KV_IMAGE_WORD

if sys.byteorder != "little":  # hash64.h reads identity bytes as little-endian words
    raise ImportError("the compiled core supports little-endian hosts only")

include "_hashing.pxi"


cdef int _check_worker(object worker) except -1:
    if type(worker) is not int or worker < 0 or worker >= 2**31:
        raise ValueError(f"a worker id is an int in [0, 2**31), not {worker!r}")
    return 0


cdef int _check_tier(object tier) except -1:
    if type(tier) is not int or tier not in (0, 1):
        raise ValueError(f"tier must be Tier.DEVICE (0) or Tier.HOST (1), not {tier!r}")
    return <int>tier


cdef int _read_hashes(object hashes, vector[uint64_t] &out) except -1:
    seq = PySequence_Fast(hashes, "hashes must be a sequence")
    cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i
    cdef PyObject **items = PySequence_Fast_ITEMS(seq)
    out.resize(n)
    for i in range(n):
        if not kv_u64(items[i], &out[i]):
            raise ValueError(f"a block hash is an int in [0, 2**64), not {<object>items[i]!r}")
    return 0


cdef inline cbool _is_u64(object value):
    cdef uint64_t ignored
    return kv_u64(<PyObject *>value, &ignored)


cdef enum:
    STORED_BLOCKS
    REMOVED_BLOCKS
    UNKNOWN_PARENT
    UNKNOWN_REMOVAL
    BLOCK_SIZE_MISMATCH
    MALFORMED_STORES
    UNHASHABLE_IMAGES
    BAD_TOKENS
    CLEARS
    N_STATS


cdef class PrefixIndex:
    """Which workers hold which prefix blocks, on which tier.

    Args:
        block_size: tokens per block; stores with another block size are skipped.

    Raises:
        ValueError: ``block_size`` is not a positive int.
    """

    cdef Index *core
    cdef unordered_map[uint32_t, uint32_t] dense
    cdef unordered_map[uint32_t, uint64_t] mismatches  # worker -> block-size mismatches
    cdef readonly object block_size
    cdef size_t bs
    cdef uint64_t counts[N_STATS]
    cdef vector[uint64_t] eng, loc
    cdef vector[Result] results

    def __cinit__(self, block_size):
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive int, not {block_size!r}")
        self.block_size = block_size
        self.bs = block_size
        self.core = new Index()
        cdef int k
        for k in range(N_STATS):
            self.counts[k] = 0

    def __dealloc__(self):
        del self.core

    cdef long _dense_of(self, uint32_t worker):
        cdef unordered_map[uint32_t, uint32_t].iterator it = self.dense.find(worker)
        return -1 if it == self.dense.end() else <long>deref(it).second

    cdef uint32_t _dense_or_add(self, uint32_t worker) except? 0:
        cdef long d = self._dense_of(worker)
        if d < 0:
            d = self.core.add_worker(worker)
            self.dense[worker] = <uint32_t>d
        return <uint32_t>d

    def apply(self, worker, event):
        """Apply one normalised event from ``worker``'s stream.

        Bad stream input is counted in :meth:`stats` and skipped, never raised.

        Args:
            worker: the publishing worker.
            event: a :class:`~indexer.events.Stored`, ``Removed`` or ``Cleared``.

        Raises:
            ValueError: ``worker`` is out of range or ``event`` is not one of those types.
        """
        _check_worker(worker)
        self._apply(worker, event)

    def apply_batch(self, worker, events):
        """Apply a batch of ``worker``'s events in order; see :meth:`apply`.

        Raises:
            ValueError: as :meth:`apply`; the events before the bad one stay applied.
        """
        _check_worker(worker)
        for event in events:
            self._apply(worker, event)

    cdef int _apply(self, uint32_t worker, object event) except -1:
        cdef type kind = type(event)
        if kind is Stored:
            self._stored(worker, event)
        elif kind is Removed:
            self._removed(worker, event)
        elif kind is Cleared:
            self.counts[CLEARS] += 1
            self._clear(worker)
        else:
            raise ValueError(f"not a KV event: {kind.__name__}")
        return 0

    cdef int _stored(self, uint32_t worker, object ev) except -1:
        cdef size_t bs = self.bs, nb, i
        cdef int saw_str = 0, tier
        cdef long d
        cdef uint64_t start = KV_GLOBAL_SEED
        cdef Entry *e
        if ev.block_size != self.block_size:
            self.counts[BLOCK_SIZE_MISMATCH] += 1
            self.mismatches[worker] += 1
            warn_block_size_mismatch(worker, ev.block_size, self.block_size,
                                     self.mismatches[worker])
            return 0
        hashes = ev.block_hashes
        tokens = ev.token_ids
        parent = ev.parent_block_hash
        nb = len(hashes)
        if <size_t>len(tokens) != nb * bs or not (parent is None or _is_u64(parent)):
            self.counts[MALFORMED_STORES] += 1
            return 0
        self.eng.resize(nb)
        seq = PySequence_Fast(hashes, "block_hashes must be a sequence")
        cdef PyObject **items = PySequence_Fast_ITEMS(seq)
        for i in range(nb):
            if not kv_u64(items[i], &self.eng[i]):
                self.counts[MALFORMED_STORES] += 1
                return 0
        d = self._dense_of(worker)
        if parent is not None:
            e = NULL
            if d >= 0:
                e = self.core.workers[d].engine.find(PyLong_AsUnsignedLongLong(parent))
            if e == NULL:
                self.counts[UNKNOWN_PARENT] += 1
                return 0
            start = e.local
        mm = None
        cold = False
        extra = ev.extra_keys
        if (ev.mm_keys is not None
                or (extra is not None and any(x is not None for x in extra))
                or (parent is None and (ev.lora_name is not None or ev.lora_id is not None
                                        or ev.cache_salt is not None))):
            try:
                seed, mm = event_hash_input(ev)
            except UnhashableStore:
                self.counts[UNHASHABLE_IMAGES] += 1
                return 0
            if parent is None:
                start = seed
            cold = True
        try:
            _chain(start, tokens, bs, mm, self.loc, &saw_str)
        except ValueError:
            if not cold and any(isinstance(t, str) for t in tokens):
                self.counts[UNHASHABLE_IMAGES] += 1
            else:
                self.counts[BAD_TOKENS] += 1
            return 0
        if saw_str and not cold:  # image positions, and the event names no items
            self.counts[UNHASHABLE_IMAGES] += 1
            return 0
        medium = ev.medium
        tier = 0 if medium is None else tier_of(medium)
        self.core.store(self._dense_or_add(worker), self.eng.data(), self.loc.data(), nb, tier)
        self.counts[STORED_BLOCKS] += nb
        return 0

    cdef int _removed(self, uint32_t worker, object ev) except -1:
        hashes = ev.block_hashes
        cdef size_t n = len(hashes), kept = 0, removed
        cdef long d = self._dense_of(worker)
        medium = ev.medium
        cdef int tier = 0 if medium is None else tier_of(medium)
        if d < 0:
            self.counts[UNKNOWN_REMOVAL] += n
            return 0
        self.eng.resize(n)
        seq = PySequence_Fast(hashes, "block_hashes must be a sequence")
        cdef PyObject **items = PySequence_Fast_ITEMS(seq)
        cdef size_t i
        for i in range(n):
            if kv_u64(items[i], &self.eng[kept]):
                kept += 1
        removed = self.core.remove(<uint32_t>d, self.eng.data(), kept, tier)
        self.counts[REMOVED_BLOCKS] += removed
        self.counts[UNKNOWN_REMOVAL] += n - removed
        return 0

    def store_hashes(self, worker, local_hashes, tier=0):
        """Mark local hashes resident on ``worker``'s tier without an engine hash.

        For predicted residency and for routing without events. Idempotent per hash.

        Raises:
            ValueError: the worker, a hash or the tier is out of range.
        """
        _check_worker(worker)
        cdef int t = _check_tier(tier)
        _read_hashes(local_hashes, self.loc)
        self.core.set_direct(self._dense_or_add(worker), self.loc.data(), self.loc.size(), t,
                             True)

    def remove_hashes(self, worker, local_hashes, tier=0):
        """Undo :meth:`store_hashes` for these hashes on ``worker``'s tier.

        Residency that came from events stays. Hashes not stored directly are ignored.

        Raises:
            ValueError: the worker, a hash or the tier is out of range.
        """
        _check_worker(worker)
        cdef int t = _check_tier(tier)
        _read_hashes(local_hashes, self.loc)
        cdef long d = self._dense_of(worker)
        if d >= 0:
            self.core.set_direct(<uint32_t>d, self.loc.data(), self.loc.size(), t, False)

    cdef void _clear(self, uint32_t worker):
        cdef long d = self._dense_of(worker)
        if d >= 0:
            self.core.clear(<uint32_t>d)

    def clear(self, worker):
        """Forget every block ``worker`` holds (its cache was cleared); it stays known.

        Raises:
            ValueError: ``worker`` is out of range.
        """
        _check_worker(worker)
        self._clear(worker)

    def remove_worker(self, worker):
        """Forget ``worker`` entirely (it left the deployment).

        Raises:
            ValueError: ``worker`` is out of range.
        """
        _check_worker(worker)
        cdef long d = self._dense_of(worker)
        self.mismatches.erase(<uint32_t>worker)
        if d >= 0:
            self.core.drop_worker(<uint32_t>d)
            self.dense.erase(<uint32_t>worker)

    def match(self, local_hashes):
        """Return, per worker, how many leading blocks of a prompt it holds.

        Args:
            local_hashes: the prompt's chained local hashes (:func:`block_hashes`).

        Returns:
            ``{worker: (matched_blocks, device_matched_blocks)}``: the leading run held on any
            tier and the leading run held on the device tier, for workers with a run > 0.

        Raises:
            ValueError: a hash is not an int in ``[0, 2**64)``.
        """
        _read_hashes(local_hashes, self.loc)
        self.core.match(self.loc.data(), self.loc.size(), self.results)
        cdef dict out = {}
        cdef Result r
        for r in self.results:
            out[self.core.workers[r.w].id] = (r.matched, r.device_matched)
        return out

    def engine_hashes(self, worker):
        """Return ``worker``'s engine hashes and their tiers (bit 0 device, bit 1 host)."""
        _check_worker(worker)
        cdef long d = self._dense_of(worker)
        cdef dict out = {}
        cdef size_t k
        cdef Worker *w
        if d >= 0:
            w = self.core.workers[d]
            for k in range(w.engine.cap):
                if w.engine.a[k].tiers:
                    out[w.engine.a[k].key] = w.engine.a[k].tiers
        return out

    def num_blocks(self):
        """Return the number of distinct local hashes resident on any worker."""
        return self.core.blocks.count

    def worker_blocks(self, worker):
        """Return how many distinct blocks ``worker`` holds on (device, host)."""
        _check_worker(worker)
        cdef long d = self._dense_of(worker)
        if d < 0:
            return (0, 0)
        return (self.core.workers[d].blocks[0], self.core.workers[d].blocks[1])

    def workers(self):
        """Return the workers the index knows, in ascending order."""
        return sorted(p.first for p in self.dense)

    def memory_bytes(self):
        """Return the memory the index holds: table capacities, spills and worker maps."""
        return (self.core.memory_bytes() + sizeof(PrefixIndex)
                + (self.dense.size() + self.mismatches.size()) * 32)

    def stats(self):
        """Return the event counters (:data:`indexer.radix.STAT_NAMES`)."""
        return {name: self.counts[k] for k, name in enumerate(STAT_NAMES)}
