/* Router-local block hashing in C: the same values as indexer/hashing.py, word for word.
 *
 * See indexer/hashing.py for the definition. Also here: reading a Python list of token ids
 * into 64-bit words without a function call per small int, which is most of the cost of
 * hashing a long prompt.
 */
#ifndef KVROUTE_HASH64_H
#define KVROUTE_HASH64_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KV_P0 0xA0761D6478BD642FULL
#define KV_P1 0xE7037ED1A0B428DBULL
#define KV_P2 0x8EBC6AF09C88C6E3ULL
#define KV_P3 0x589965CC75374CC3ULL
#define KV_GLOBAL_SEED 0x6B76726F75746500ULL
#define KV_IMAGE_WORD 0x696D616765000000ULL
#define KV_IDENTITY_SEED 0x6964656E74697479ULL
#define KV_SCOPE_TAG 0x73636F7065000000ULL

static inline uint64_t kv_mix(uint64_t a, uint64_t b) {
#if defined(__x86_64__) && defined(__GNUC__)
    /* GCC spills the halves of an __int128 product to the stack in the token loop (a store
     * and a reload per multiply); naming RDX:RAX keeps them in registers: -0.6 us of 8k. */
    uint64_t lo, hi;
    __asm__("mulq %3" : "=a"(lo), "=d"(hi) : "a"(a), "rm"(b) : "cc");
    return lo ^ hi;
#else
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
#endif
}

static inline uint64_t kv_fmix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    return x ^ (x >> 33);
}

/* Sum of independent pair mixes: the multiplies overlap in the pipeline. */
static inline uint64_t kv_absorb(const uint64_t *w, size_t n) {
    uint64_t acc0 = 0, acc1 = 0, k = 0;
    size_t j = 0;
    for (; j + 3 < n; j += 4) {
        uint64_t k0 = k + KV_P0, k1 = k + 2 * KV_P0;
        acc0 += kv_mix(w[j] ^ k0, w[j + 1] ^ k0 ^ KV_P1);
        acc1 += kv_mix(w[j + 2] ^ k1, w[j + 3] ^ k1 ^ KV_P1);
        k = k1;
    }
    for (; j < n; j += 2) {
        k += KV_P0;
        uint64_t second = j + 1 < n ? w[j + 1] : 0;
        acc0 += kv_mix(w[j] ^ k, second ^ k ^ KV_P1);
    }
    return acc0 + acc1;
}

/* finish(prev, absorb(words), length): length is the word count, or bytes for identities. */
static inline uint64_t kv_finish_len(uint64_t prev, const uint64_t *w, size_t nwords,
                                     uint64_t length) {
    return kv_fmix(kv_mix(prev ^ KV_P2 ^ length, kv_absorb(w, nwords) ^ KV_P3));
}

static inline uint64_t kv_finish(uint64_t prev, const uint64_t *w, size_t n) {
    return kv_finish_len(prev, w, n, (uint64_t)n);
}

/* Chain `blocks` full blocks of `block_size` words each from `prev` into out[]. */
static inline void kv_chain(uint64_t prev, const uint64_t *words, size_t blocks,
                            size_t block_size, uint64_t *out) {
    for (size_t b = 0; b < blocks; b++) {
        prev = kv_finish(prev, words + b * block_size, block_size);
        out[b] = prev;
    }
}

static inline uint64_t kv_identity_hash(const char *data, size_t len) {
    uint64_t stack[32];
    size_t nwords = (len + 7) / 8;
    uint64_t *w = nwords <= 32 ? stack : (uint64_t *)PyMem_Malloc(nwords * 8);
    if (w == NULL) return 0; /* out of memory: identities over 256 bytes only */
    if (nwords) {
        w[nwords - 1] = 0;
        memcpy(w, data, len); /* little-endian hosts: bytes are words (checked at import) */
    }
    uint64_t h = kv_finish_len(KV_IDENTITY_SEED, w, nwords, (uint64_t)len);
    if (w != stack) PyMem_Free(w);
    return h;
}

/* A token id stored in a single CPython digit (or compact int): read in place. */
static inline int kv_small_token(PyObject *o, uint64_t *out) {
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) return 0;
    Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)o);
    if (v < 0) return 0;
    *out = (uint64_t)v;
    return 1;
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size == 1) {
        *out = ((PyLongObject *)o)->ob_digit[0];
        return 1;
    }
    if (size == 0) {
        *out = 0;
        return 1;
    }
    return 0;
#endif
}

/* Read an exact int in [0, 2**64) without raising: returns 1 and sets *out, else 0. */
static inline int kv_u64(PyObject *o, uint64_t *out) {
    if (kv_small_token(o, out)) return 1;
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    /* A block hash is usually a 3-digit int: read the digits in place. */
    Py_ssize_t size = Py_SIZE(o);
    const digit *d = ((PyLongObject *)o)->ob_digit;
    if (size == 2) {
        *out = (uint64_t)d[0] | (uint64_t)d[1] << 30;
        return 1;
    }
    if (size == 3 && d[2] < 16) {
        *out = (uint64_t)d[0] | (uint64_t)d[1] << 30 | (uint64_t)d[2] << 60;
        return 1;
    }
    if (size < 0 || size > 3) return 0;
#endif
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* Absorb one block straight from a list of token objects, scalar: returns 0 when some token is
 * not a compact non-negative int, else 1 with the block's sum in *acc. */
static inline int kv_absorb_objects_scalar(PyObject **w, size_t n, uint64_t *acc) {
    uint64_t acc0 = 0, acc1 = 0, k = 0, x0, x1, x2, x3;
    size_t j = 0;
    for (; j + 3 < n; j += 4) {
        if (!(kv_small_token(w[j], &x0) & kv_small_token(w[j + 1], &x1) &
              kv_small_token(w[j + 2], &x2) & kv_small_token(w[j + 3], &x3)))
            return 0;
        uint64_t k0 = k + KV_P0, k1 = k + 2 * KV_P0;
        acc0 += kv_mix(x0 ^ k0, x1 ^ k0 ^ KV_P1);
        acc1 += kv_mix(x2 ^ k1, x3 ^ k1 ^ KV_P1);
        k = k1;
    }
    for (; j < n; j += 2) {
        k += KV_P0;
        x1 = 0;
        if (!kv_small_token(w[j], &x0) || (j + 1 < n && !kv_small_token(w[j + 1], &x1)))
            return 0;
        acc0 += kv_mix(x0 ^ k, x1 ^ k ^ KV_P1);
    }
    *acc = acc0 + acc1;
    return 1;
}

#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30 && defined(__SSE2__)
#include <emmintrin.h>
#define KV_FAST_OBJECTS 1
/* The same as kv_absorb_objects_scalar with one branch per token instead of four (3.11
 * layout). After the type check, one 16-byte load takes ob_type and ob_size together; their
 * running OR and AND over the block say at the end whether every size was 1. The digit is
 * used as read, so a block with a size-0 int (zero, whose digit need not be 0) or a size
 * other than 1 is redone by the scalar reader. Per-token work is what the time goes on:
 * this halves it (docs/prefix_index.md). */
static inline int kv_absorb_objects(PyObject **w, size_t n, uint64_t *acc) {
    const PyTypeObject *T = &PyLong_Type;
    uint64_t acc0 = 0, acc1 = 0, k = 0;
    __m128i any = _mm_setzero_si128(), all = _mm_set1_epi32(-1);
    size_t j = 0;
#define KV_READ(o_, x_)                                                              \
    do {                                                                             \
        PyObject *o = (o_);                                                          \
        if (Py_TYPE(o) != T) return 0;                                               \
        __m128i v = _mm_loadu_si128((const __m128i *)&((PyVarObject *)o)->ob_base.ob_type); \
        any = _mm_or_si128(any, v);                                                  \
        all = _mm_and_si128(all, v);                                                 \
        x_ = ((PyLongObject *)o)->ob_digit[0];                                       \
    } while (0)
    for (; j + 3 < n; j += 4) {
        uint64_t x0, x1, x2, x3;
        KV_READ(w[j], x0);
        KV_READ(w[j + 1], x1);
        KV_READ(w[j + 2], x2);
        KV_READ(w[j + 3], x3);
        uint64_t k0 = k + KV_P0, k1 = k + 2 * KV_P0;
        acc0 += kv_mix(x0 ^ k0, x1 ^ k0 ^ KV_P1);
        acc1 += kv_mix(x2 ^ k1, x3 ^ k1 ^ KV_P1);
        k = k1;
    }
    for (; j < n; j += 2) {
        uint64_t x0, x1 = 0;
        k += KV_P0;
        KV_READ(w[j], x0);
        if (j + 1 < n) KV_READ(w[j + 1], x1);
        acc0 += kv_mix(x0 ^ k, x1 ^ k ^ KV_P1);
    }
#undef KV_READ
    Py_ssize_t size_any, size_all;
    memcpy(&size_any, (const char *)&any + 8, 8);
    memcpy(&size_all, (const char *)&all + 8, 8);
    if (size_any != 1 || size_all != 1) return kv_absorb_objects_scalar(w, n, acc);
    *acc = acc0 + acc1;
    return 1;
}
#else
#define kv_absorb_objects kv_absorb_objects_scalar
#endif

/* Hash full blocks straight from a list of small ints, reading and mixing in one pass so
 * the loads of one pair overlap the multiplies of the last. Returns 0 when some token is
 * not a small int (the caller then takes the general path), else 1. */
static inline int kv_chain_small(uint64_t prev, PyObject **items, size_t blocks,
                                 size_t block_size, uint64_t *out) {
    for (size_t b = 0; b < blocks; b++) {
        uint64_t acc;
        if (!kv_absorb_objects(items + b * block_size, block_size, &acc)) return 0;
        prev = kv_fmix(kv_mix(prev ^ KV_P2 ^ (uint64_t)block_size, acc ^ KV_P3));
        out[b] = prev;
    }
    return 1;
}

/* A new int for a 64-bit hash. On 3.11 it is built from its 30-bit digits directly, which
 * skips PyLong_FromUnsignedLongLong's digit-counting loop (0.7 us of 256 results). */
static inline PyObject *kv_pylong_u64(uint64_t v) {
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    if (v >> 30) {
        Py_ssize_t n = v >> 60 ? 3 : 2;
        PyLongObject *r = _PyLong_New(n);
        if (r == NULL) return NULL;
        r->ob_digit[0] = (digit)(v & PyLong_MASK);
        r->ob_digit[1] = (digit)(v >> 30 & PyLong_MASK);
        if (n == 3) r->ob_digit[2] = (digit)(v >> 60);
        return (PyObject *)r;
    }
#endif
    return PyLong_FromUnsignedLongLong(v);
}

/* Read token ids into words. Returns -1 when all are usable, else the index of the first
 * token that is neither an int in [0, 2**64) nor a str (no Python error left set).
 * *saw_str is set when a str (an image position, hashed as KV_IMAGE_WORD) was seen. */
static inline Py_ssize_t kv_token_words(PyObject **items, Py_ssize_t n, uint64_t *out,
                                        int *saw_str) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        if (PyLong_CheckExact(o)) {
#if PY_VERSION_HEX >= 0x030C0000
            if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
                Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)o);
                if (v < 0) return i;
                out[i] = (uint64_t)v;
                continue;
            }
#else
            Py_ssize_t size = Py_SIZE(o);
            if (size == 1) {
                out[i] = ((PyLongObject *)o)->ob_digit[0];
                continue;
            }
            if (size == 0) {
                out[i] = 0;
                continue;
            }
            if (size < 0) return i;
#endif
            unsigned long long v = PyLong_AsUnsignedLongLong(o);
            if (v == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return i;
            }
            out[i] = v;
        } else if (PyUnicode_Check(o)) {
            out[i] = KV_IMAGE_WORD;
            *saw_str = 1;
        } else {
            return i;
        }
    }
    return -1;
}

#endif
