/* The open-addressing table the index core is made of, and the memory floor it is judged by.
 *
 * Linear probing over a power-of-two array of entries, at most 80% full, with backward-shift
 * deletion (no tombstones, so probe sequences stay short under churn). An entry type says
 * whether it is used (`used()`) and holds its 64-bit `key`; keys are hashes already, and a
 * Fibonacci multiply spreads hand-made ones (small ints in tests, sequential ids).
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

/* Open addressing with linear probing over a power-of-two array, at most 80% full. */
template <class T>
struct Table {
    T *a = nullptr;
    size_t cap = 0, count = 0;
    unsigned shift = 64;

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
        shift = 64 - (unsigned)__builtin_ctzll(c);
    }
    size_t home(uint64_t key) const {
        return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> shift);
    }
    void prefetch(uint64_t key) const { __builtin_prefetch(&a[home(key)]); }
    T *find(uint64_t key) const {
        size_t mask = cap - 1;
        for (size_t i = home(key);; i = (i + 1) & mask) {
            T *s = &a[i];
            if (!s->used()) return nullptr;
            if (s->key == key) return s;
        }
    }
    /* A new entry for an absent key; the caller marks it used before the next call. */
    T *insert(uint64_t key) {
        if ((count + 1) * 5 > cap * 4) grow();
        size_t mask = cap - 1, i = home(key);
        while (a[i].used()) i = (i + 1) & mask;
        a[i].key = key;
        count++;
        return &a[i];
    }
    void erase(T *s) {
        size_t mask = cap - 1, i = (size_t)(s - a);
        for (size_t j = (i + 1) & mask; a[j].used(); j = (j + 1) & mask) {
            size_t h = home(a[j].key);
            if (((j - h) & mask) >= ((j - i) & mask)) {
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
        reset(cap * 2);
        size_t mask = cap - 1;
        for (size_t k = 0; k < old_cap; k++) {
            if (!old[k].used()) continue;
            size_t i = home(old[k].key);
            while (a[i].used()) i = (i + 1) & mask;
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
