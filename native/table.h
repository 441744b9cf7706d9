/* The open-addressing table the index core is made of, and the memory floor it is judged by.
 *
 * Linear probing over an array of entries with backward-shift deletion (no tombstones, so
 * probe sequences stay short under churn). An entry type says whether it is used (`used()`)
 * and holds its 64-bit `key`; keys are hashes already, and a Fibonacci multiply spreads
 * hand-made ones (small ints in tests, sequential ids).
 *
 * Capacities are not powers of two: a table grows by 1/GROW_DIV of itself when it would be
 * more than LOAD_NUM/LOAD_DEN full, and a key's home slot is Lemire's multiply-shift
 * reduction of the spread key onto [0, cap). With doubling, a table that just missed a power
 * of two sat at 47% load: 117.5 bytes per block-worker pair at 1M blocks, 86 now. Dense
 * linear probing is slow where it matters (misses and erases walk clusters), so the block
 * table stays 53-67% full and grows 1.25x; the engine maps, off the query path, run to 80%
 * and grow 1.5x (docs/prefix_index.md).
 */
#ifndef KVROUTE_TABLE_H
#define KVROUTE_TABLE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <new>
#include <vector>

namespace kvr {

/* Open addressing with linear probing, at most LOAD_NUM/LOAD_DEN full, growing by 1/GROW_DIV. */
template <class T, size_t LOAD_NUM = 4, size_t LOAD_DEN = 5, size_t GROW_DIV = 2>
struct Table {
    T *a = nullptr;
    size_t cap = 0, count = 0;

    Table() { reset(16); }
    ~Table() { free(a); }
    Table(const Table &) = delete;
    Table &operator=(const Table &) = delete;

    void reset(size_t c) {
        free(a);
        void *p = nullptr;
        if (posix_memalign(&p, 64, c * sizeof(T))) throw std::bad_alloc();
        memset(p, 0, c * sizeof(T));
        a = (T *)p;
        cap = c;
        count = 0;
    }
    size_t home(uint64_t key) const {
        return (size_t)(((__uint128_t)(key * 0x9E3779B97F4A7C15ULL) * cap) >> 64);
    }
    size_t next(size_t i) const { return i + 1 == cap ? 0 : i + 1; }
    /* Probe distance from slot `from` forward to slot `to`, wrapping at cap. */
    size_t dist(size_t from, size_t to) const { return to >= from ? to - from : to + cap - from; }
    /* The home slot's cache line and the next: at 55-67% load a key is often a slot or two
     * past its home, and a demand miss on the second line would serialise a query
     * (measured: match p99 7.0 -> 6.5 us, apply 3.9 -> 4.4 M/s at 1M blocks). */
    void prefetch(uint64_t key) const {
        const char *p = (const char *)&a[home(key)];
        __builtin_prefetch(p);
        __builtin_prefetch(p + 64);
    }
    T *find(uint64_t key) const {
        for (size_t i = home(key);; i = next(i)) {
            T *s = &a[i];
            if (!s->used()) return nullptr;
            if (s->key == key) return s;
        }
    }
    /* A new entry for an absent key; the caller marks it used before the next call. */
    T *insert(uint64_t key) {
        if ((count + 1) * LOAD_DEN > cap * LOAD_NUM) grow();
        size_t i = home(key);
        while (a[i].used()) i = next(i);
        a[i].key = key;
        count++;
        return &a[i];
    }
    void erase(T *s) {
        size_t i = (size_t)(s - a);
        for (size_t j = next(i); a[j].used(); j = next(j)) {
            if (dist(home(a[j].key), j) >= dist(i, j)) {
                a[i] = a[j];
                i = j;
            }
        }
        memset(&a[i], 0, sizeof(T));
        count--;
    }
    void grow() {
        T *old = a;
        size_t old_cap = cap, n = count;
        a = nullptr;
        reset(cap + cap / GROW_DIV);
        for (size_t k = 0; k < old_cap; k++) {
            if (!old[k].used()) continue;
            size_t i = home(old[k].key);
            while (a[i].used()) i = next(i);
            a[i] = old[k];
        }
        count = n;
        free(old);
    }
    size_t bytes() const { return cap * sizeof(T); }
};

/* The memory system's floor for one query: `reads` independent random loads from a table of
 * `table_bytes`, all prefetched first. Returns the median over `rounds` in nanoseconds. */
inline double floor_reads_ns(size_t table_bytes, size_t reads, size_t rounds) {
    size_t n = 1;
    while (n * 2 * sizeof(uint64_t) <= table_bytes) n *= 2;
    std::vector<uint64_t> table(n);
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    for (size_t i = 0; i < n; i++) table[i] = x = x * 6364136223846793005ULL + 1;
    std::vector<size_t> idx(reads);
    std::vector<double> times(rounds);
    volatile uint64_t sink = 0;
    for (size_t r = 0; r < rounds; r++) {
        for (size_t i = 0; i < reads; i++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            idx[i] = (size_t)(x >> 20) & (n - 1);
        }
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (size_t i = 0; i < reads; i++) __builtin_prefetch(&table[idx[i]]);
        uint64_t acc = 0;
        for (size_t i = 0; i < reads; i++) acc += table[idx[i]];
        clock_gettime(CLOCK_MONOTONIC, &t1);
        sink = sink + acc;
        times[r] = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    }
    std::nth_element(times.begin(), times.begin() + rounds / 2, times.end());
    return times[rounds / 2];
}

}  // namespace kvr

#endif
