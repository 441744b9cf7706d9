# Block hashing of the compiled core: the same functions and values as indexer/hashing.py.
# Included by _core.pyx (one extension module); the C side is hash64.h.

cdef uint64_t U64_MAX = 0xFFFFFFFFFFFFFFFF
cdef vector[uint64_t] _words  # scratch: one call at a time (the GIL is held throughout)
cdef vector[uint64_t] _out


cdef inline uint64_t _u64(object value, str what) except? 0:
    cdef uint64_t out = 0
    if not kv_u64(<PyObject *>value, &out):
        raise ValueError(f"{what} must be an int in [0, 2**64), not {value!r}")
    return out


def identity_hash(str identity):
    """Return the 64-bit hash of a multimodal item's identity (a UUID or a hex digest).

    The identity's UTF-8 bytes are read as little-endian 64-bit words (the last one padded
    with zero bytes) and finished with the byte length from a fixed seed.
    """
    cdef bytes data = identity.encode("utf-8")
    return kv_identity_hash(data, len(data))


def scope_seed(lora, salt):
    """Return the chain root for a reuse scope.

    Args:
        lora: the LoRA adapter's name (``"id:<n>"`` when an engine gives only its id), or None.
        salt: the cache salt exactly as the engine publishes it, or None.

    Returns:
        :data:`GLOBAL_SEED` when both are None, else a seed that no other scope shares.
    """
    if lora is None and salt is None:
        return KV_GLOBAL_SEED
    cdef uint64_t w[5]
    w[0] = KV_SCOPE_TAG
    w[1] = 0 if lora is None else 1
    w[2] = 0 if lora is None else identity_hash(lora)
    w[3] = 0 if salt is None else 1
    w[4] = 0 if salt is None else identity_hash(salt)
    return kv_finish(KV_GLOBAL_SEED, w, 5)


def memory_floor_us(table_bytes, reads=128, rounds=2000):
    """Return the median time of ``reads`` independent random reads from a plain table.

    The memory system's floor for one query of the index: the reads are 8-byte loads from a
    table of ``table_bytes``, all prefetched before any is used, as a tuned core would.
    A benchmark helper (``bench.index``); not part of the index API.
    """
    return floor_reads_ns(table_bytes, reads, rounds) / 1000.0


cdef list _as_list(const uint64_t *values, size_t n):
    cdef list out = PyList_New(n)
    cdef size_t i
    for i in range(n):
        item = kv_pylong_u64(values[i])
        PyList_SET_ITEM(out, i, item)
        (<PyObject *>item).ob_refcnt += 1  # PyList_SET_ITEM steals the reference
    return out


cdef int _chain(uint64_t prev, object tokens, size_t block_size, object mm,
                vector[uint64_t] &out, int *saw_str) except -1:
    """Hash the full blocks of ``tokens`` into ``out``; ValueError on bad input.

    ``saw_str`` is set when a token is a str (an image position).
    """
    seq = PySequence_Fast(tokens, "tokens must be a sequence")
    cdef size_t blocks = <size_t>PySequence_Fast_GET_SIZE(seq) // block_size
    cdef size_t b
    if mm is not None and <size_t>len(mm) < blocks:
        raise ValueError(f"mm has {len(mm)} entries for {blocks} full blocks")
    out.resize(blocks)
    if mm is None and kv_chain_small(prev, PySequence_Fast_ITEMS(seq), blocks, block_size,
                                     out.data()):
        return 0
    _words.resize(blocks * block_size + 2)
    cdef Py_ssize_t bad = kv_token_words(PySequence_Fast_ITEMS(seq), blocks * block_size,
                                         _words.data(), saw_str)
    if bad >= 0:
        raise ValueError(f"token ids are ints in [0, 2**64) or str, not {seq[bad]!r}")
    if mm is None:
        kv_chain(prev, _words.data(), blocks, block_size, out.data())
        return 0
    cdef vector[uint64_t] block
    for b in range(blocks):
        block.assign(_words.data() + b * block_size, _words.data() + (b + 1) * block_size)
        for identity, offset in mm[b]:
            if not isinstance(identity, str):
                raise ValueError(f"a multimodal identity is a str, not {identity!r}")
            block.push_back(identity_hash(identity))
            block.push_back(_u64(offset, "a multimodal offset"))
        prev = kv_finish(prev, block.data(), block.size())
        out[b] = prev
    return 0


def block_hashes(tokens, block_size, *, seed, parent=None, mm=None):
    """Return the chained local hash of each full block of ``tokens``.

    A trailing partial block is not hashed.

    Args:
        tokens: token ids (ints in ``[0, 2**64)``) or ``str`` at multimodal positions.
        block_size: tokens per block, at least 1.
        seed: the chain root (:func:`scope_seed`) used when ``parent`` is None.
        parent: the local hash of the block before the first one, for a chain's continuation.
        mm: per full block, the ``(identity, start_offset)`` of each multimodal item that
            overlaps it; at least one entry per full block when given.

    Returns:
        One unsigned 64-bit hash per full block, in chain order.

    Raises:
        ValueError: a token, seed, parent, block size or multimodal entry is out of range.
    """
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be a positive int, not {block_size!r}")
    cdef uint64_t prev = _u64(seed, "seed") if parent is None else _u64(parent, "parent")
    cdef int saw_str = 0
    _chain(prev, tokens, block_size, mm, _out, &saw_str)
    return _as_list(_out.data(), _out.size())
