/* The prefix index's C++ core: cache-aware tables, no Python objects per block.
 *
 * Mirrors indexer/radix.py (the specification); see its notes for the semantics.
 *
 * Layout, chosen so that a query touches one cache line per block:
 *   1. Blocks: one open-addressing table (linear probing, backward-shift deletion, no
 *      tombstones) of 32-byte slots, two to a cache line. A slot holds the local hash and up
 *      to two holders inline; a block held by more workers keeps its holders, sorted by
 *      worker, in a spill array. Holder state packs per-tier reference counts and the direct
 *      flags into 32 bits.
 *   2. Workers: dense indices (reused after remove_worker); each owns an open-addressing map
 *      engine hash -> (local hash, tiers) and a set of directly stored local hashes.
 *   3. Keys are already uniform 64-bit hashes; a Fibonacci multiply spreads hand-made ones.
 */
#ifndef KVROUTE_INDEX_CORE_H
#define KVROUTE_INDEX_CORE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <new>
#include <vector>

#include "table.h"

namespace kvr {

static const uint32_t DEV_ONE = 1u, HOST_ONE = 1u << 15;
static const uint32_t DIRECT_DEV = 1u << 30, DIRECT_HOST = 1u << 31;
static const uint32_t ON_DEV = 0x7fffu | DIRECT_DEV;
static const uint32_t ON_HOST = (0x7fffu << 15) | DIRECT_HOST;

inline uint32_t on_mask(int tier) { return tier ? ON_HOST : ON_DEV; }

struct Holder {
    uint32_t w;   /* dense worker index */
    uint32_t st;  /* device refs (15 bits) | host refs (15) | direct device | direct host */
};

/* A block; empty when n == 0. With more than two holders, they live in a spill array and
 * the inline space holds two bitmasks over dense workers 0..63: holders on any tier and on
 * the device, so that a query of a deployment of up to 64 workers reads nothing but the slot. */
struct Slot {
    uint64_t key;
    uint32_t n;
    uint32_t spill;
    Holder h[2];
    bool used() const { return n != 0; }
};

inline void slot_masks(const Slot *s, uint64_t &any, uint64_t &dev) {
    if (s->n > 2) {
        memcpy(&any, &s->h[0], 8);
        memcpy(&dev, &s->h[1], 8);
        return;
    }
    any = dev = 0;
    for (uint32_t k = 0; k < s->n; k++) {
        uint64_t bit = 1ULL << (s->h[k].w & 63);
        any |= bit;
        if (s->h[k].st & ON_DEV) dev |= bit;
    }
}

struct Entry {  /* engine hash -> local hash (or a direct local hash); empty when tiers == 0 */
    uint64_t key;
    uint64_t local;
    uint32_t tiers;
    uint32_t pad;
    bool used() const { return tiers != 0; }
};

struct Worker {
    uint32_t id = 0;
    Table<Entry> engine;  /* engine hash -> local hash, tiers */
    Table<Entry> direct;  /* local hash -> tiers, from store_hashes */
    uint64_t blocks[2] = {0, 0};
};

struct Result {
    uint32_t w, matched, device_matched;
};

struct Index {
    Table<Slot, 2, 3, 4> blocks;  /* at most 2/3 full, +25% per growth: see table.h */
    std::vector<std::vector<Holder>> spills;
    std::vector<uint32_t> free_spills;
    std::vector<Worker *> workers;  /* by dense index; nullptr when free */
    std::vector<uint32_t> free_workers;
    struct Active {
        uint32_t w, dev_run;
        bool dev_alive;
    };
    std::vector<Active> active;

    ~Index() {
        for (Worker *w : workers) delete w;
    }

    /* -- workers ------------------------------------------------------------------------ */

    uint32_t add_worker(uint32_t id) {
        uint32_t d;
        if (!free_workers.empty()) {
            d = free_workers.back();
            free_workers.pop_back();
        } else {
            d = (uint32_t)workers.size();
            workers.push_back(nullptr);
        }
        workers[d] = new Worker();
        workers[d]->id = id;
        return d;
    }
    void drop_worker(uint32_t d) {
        clear(d);
        delete workers[d];
        workers[d] = nullptr;
        free_workers.push_back(d);
    }

    /* -- holders of a block --------------------------------------------------------------- */

    Holder *holders(Slot *s) { return s->n <= 2 ? s->h : spills[s->spill].data(); }

    Holder *find_holder(Slot *s, uint32_t w) {
        Holder *h = holders(s);
        Holder *end = h + s->n;
        Holder *p = std::lower_bound(h, end, w,
                                     [](const Holder &x, uint32_t v) { return x.w < v; });
        return p != end && p->w == w ? p : nullptr;
    }
    Holder *add_holder(Slot *s, uint32_t w) {
        Holder *h = holders(s);
        size_t pos = std::lower_bound(h, h + s->n, w,
                                      [](const Holder &x, uint32_t v) { return x.w < v; }) - h;
        if (s->n < 2) {
            memmove(&s->h[pos + 1], &s->h[pos], (s->n - pos) * sizeof(Holder));
            s->h[pos] = Holder{w, 0};
            s->n++;
            return &s->h[pos];
        }
        if (s->n == 2) {
            uint32_t k;
            if (!free_spills.empty()) {
                k = free_spills.back();
                free_spills.pop_back();
            } else {
                k = (uint32_t)spills.size();
                spills.emplace_back();
            }
            spills[k].assign(s->h, s->h + 2);
            s->spill = k;
        }
        std::vector<Holder> &v = spills[s->spill];
        v.insert(v.begin() + pos, Holder{w, 0});
        s->n++;
        return &v[pos];
    }
    void erase_holder(Slot *s, Holder *h) {
        Holder *all = holders(s);
        size_t pos = (size_t)(h - all);
        if (s->n <= 2) {
            memmove(&s->h[pos], &s->h[pos + 1], (s->n - pos - 1) * sizeof(Holder));
            s->n--;
            return;
        }
        std::vector<Holder> &v = spills[s->spill];
        v.erase(v.begin() + pos);
        s->n--;
        if (s->n == 2) {
            s->h[0] = v[0];
            s->h[1] = v[1];
            std::vector<Holder>().swap(v);
            free_spills.push_back(s->spill);
            s->spill = 0;
        }
    }

    void refresh_masks(Slot *s) {
        uint64_t any = 0, dev = 0;
        for (const Holder &h : spills[s->spill]) {
            if (h.w >= 64) continue;
            any |= 1ULL << h.w;
            if (h.st & ON_DEV) dev |= 1ULL << h.w;
        }
        memcpy(&s->h[0], &any, 8);
        memcpy(&s->h[1], &dev, 8);
    }

    /* Add or drop one reference (or the direct flag) of worker w on a tier of block key.
     * Returns +1 when the tier became resident, -1 when it stopped being, else 0. */
    int change(uint64_t key, uint32_t w, int tier, bool direct, bool add) {
        Slot *s;
        Holder *h;
        if (add) {
            s = blocks.find(key);
            if (s == nullptr) {
                s = blocks.insert(key);
                s->n = 0;
                h = add_holder(s, w);
            } else {
                h = find_holder(s, w);
                if (h == nullptr) h = add_holder(s, w);
            }
        } else {
            s = blocks.find(key);
            if (s == nullptr) return 0;
            h = find_holder(s, w);
            if (h == nullptr) return 0;
        }
        uint32_t on = on_mask(tier);
        int was = (h->st & on) != 0;
        if (direct) {
            uint32_t bit = tier ? DIRECT_HOST : DIRECT_DEV;
            h->st = add ? (h->st | bit) : (h->st & ~bit);
        } else {
            uint32_t one = tier ? HOST_ONE : DEV_ONE;
            h->st = add ? h->st + one : h->st - one;
        }
        int now = (h->st & on) != 0;
        if (h->st == 0) erase_holder(s, h);
        if (s->n == 0)
            blocks.erase(s);
        else if (s->n > 2)
            refresh_masks(s);
        return now - was;
    }

    /* -- engine hashes -------------------------------------------------------------------- */

    /* Drop the tiers in `tiers` of an engine entry; returns how many were held. */
    int drop_engine(uint32_t d, Entry *e, uint32_t tiers) {
        Worker *W = workers[d];
        uint64_t local = e->local;
        uint32_t mask = e->tiers;
        int dropped = 0;
        for (int t = 0; t < 2; t++) {
            if ((tiers >> t & 1) && (mask >> t & 1)) {
                mask &= ~(1u << t);
                W->blocks[t] += change(local, d, t, false, false);
                dropped++;
            }
        }
        if (mask)
            e->tiers = mask;
        else
            W->engine.erase(e);
        return dropped;
    }

    void store(uint32_t d, const uint64_t *eng, const uint64_t *loc, size_t n, int tier) {
        Worker *W = workers[d];
        const size_t ahead = 8;
        for (size_t i = 0; i < n && i < ahead; i++) {
            W->engine.prefetch(eng[i]);
            blocks.prefetch(loc[i]);
        }
        for (size_t i = 0; i < n; i++) {
            if (i + ahead < n) {
                W->engine.prefetch(eng[i + ahead]);
                blocks.prefetch(loc[i + ahead]);
            }
            Entry *e = W->engine.find(eng[i]);
            if (e != nullptr && e->local != loc[i]) {
                drop_engine(d, e, 3);
                e = nullptr;
            }
            uint32_t mask = e ? e->tiers : 0;
            if (mask >> tier & 1) continue;
            if (e == nullptr) {
                e = W->engine.insert(eng[i]);
                e->local = loc[i];
            }
            e->tiers = mask | (1u << tier);
            W->blocks[tier] += change(loc[i], d, tier, false, true);
        }
    }

    /* Remove engine hashes from a tier; returns how many were held there. */
    size_t remove(uint32_t d, const uint64_t *eng, size_t n, int tier) {
        Worker *W = workers[d];
        size_t removed = 0;
        const size_t ahead = 8;
        for (size_t i = 0; i < n && i < ahead; i++) W->engine.prefetch(eng[i]);
        for (size_t i = 0; i < n; i++) {
            if (i + ahead < n) W->engine.prefetch(eng[i + ahead]);
            Entry *e = W->engine.find(eng[i]);
            if (e == nullptr || !(e->tiers >> tier & 1)) continue;
            drop_engine(d, e, 1u << tier);
            removed++;
        }
        return removed;
    }

    void set_direct(uint32_t d, const uint64_t *loc, size_t n, int tier, bool add) {
        Worker *W = workers[d];
        uint32_t bit = 1u << tier;
        for (size_t i = 0; i < n; i++) {
            Entry *e = W->direct.find(loc[i]);
            uint32_t mask = e ? e->tiers : 0;
            if (add == bool(mask & bit)) continue;
            if (add) {
                if (e == nullptr) e = W->direct.insert(loc[i]);
                e->tiers = mask | bit;
            } else if (mask & ~bit) {
                e->tiers = mask & ~bit;
            } else {
                W->direct.erase(e);
            }
            W->blocks[tier] += change(loc[i], d, tier, true, add);
        }
    }

    void clear(uint32_t d) {
        Worker *W = workers[d];
        for (size_t k = 0; k < W->engine.cap; k++) {
            Entry &e = W->engine.a[k];
            for (int t = 0; t < 2 && e.used(); t++)
                if (e.tiers >> t & 1) W->blocks[t] += change(e.local, d, t, false, false);
        }
        for (size_t k = 0; k < W->direct.cap; k++) {
            Entry &e = W->direct.a[k];
            for (int t = 0; t < 2 && e.used(); t++)
                if (e.tiers >> t & 1) W->blocks[t] += change(e.key, d, t, true, false);
        }
        W->engine.reset(16);
        W->direct.reset(16);
    }

    /* -- queries -------------------------------------------------------------------------- */

    /* Per worker, the leading run of q held on any tier and on the device tier. The keys are
     * prefetched a window ahead, so the misses of one query overlap. */
    void match(const uint64_t *q, size_t n, std::vector<Result> &out) {
        out.clear();
        if (n == 0) return;
        if (workers.size() <= 64) return match_masks(q, n, out);
        const size_t ahead = 16;
        for (size_t i = 0; i < n && i < ahead; i++) blocks.prefetch(q[i]);
        Slot *s = blocks.find(q[0]);
        if (s == nullptr) return;
        active.clear();
        Holder *hs = holders(s);
        for (uint32_t k = 0; k < s->n; k++) {
            bool dev = (hs[k].st & ON_DEV) != 0;
            active.push_back(Active{hs[k].w, dev ? 1u : 0u, dev});
        }
        size_t i = 1;
        for (; i < n; i++) {
            if (i + ahead < n) blocks.prefetch(q[i + ahead]);
            s = blocks.find(q[i]);
            if (s == nullptr) break;
            hs = holders(s);
            size_t hn = s->n, p = 0, keep = 0;
            bool gallop = hn > 16 && active.size() * 8 < hn;
            for (size_t a = 0; a < active.size(); a++) {
                Active x = active[a];
                if (gallop)
                    p = std::lower_bound(hs + p, hs + hn, x.w,
                                         [](const Holder &h, uint32_t v) { return h.w < v; }) -
                        hs;
                else
                    while (p < hn && hs[p].w < x.w) p++;
                if (p < hn && hs[p].w == x.w) {
                    if (x.dev_alive) {
                        if (hs[p].st & ON_DEV)
                            x.dev_run = (uint32_t)i + 1;
                        else
                            x.dev_alive = false;
                    }
                    active[keep++] = x;
                } else {
                    out.push_back(Result{x.w, (uint32_t)i, x.dev_run});
                }
            }
            active.resize(keep);
            if (keep == 0) break;
        }
        for (const Active &x : active) out.push_back(Result{x.w, (uint32_t)i, x.dev_run});
    }

    /* match() for up to 64 dense workers: one bitmask AND per block, no holder lists. */
    void match_masks(const uint64_t *q, size_t n, std::vector<Result> &out) {
        const size_t ahead = 16;
        for (size_t i = 0; i < n && i < ahead; i++) blocks.prefetch(q[i]);
        Slot *s = blocks.find(q[0]);
        if (s == nullptr) return;
        uint64_t first, alive, dev, any_b, dev_b;
        slot_masks(s, first, dev);
        alive = first;
        uint32_t any_run[64], dev_run[64];
        for (uint64_t m = first & ~dev; m; m &= m - 1) dev_run[__builtin_ctzll(m)] = 0;
        size_t i = 1;
        for (; i < n; i++) {
            if (i + ahead < n) blocks.prefetch(q[i + ahead]);
            s = blocks.find(q[i]);
            if (s == nullptr) break;
            slot_masks(s, any_b, dev_b);
            uint64_t lost = alive & ~any_b, lost_dev = dev & ~dev_b;
            for (; lost; lost &= lost - 1) any_run[__builtin_ctzll(lost)] = (uint32_t)i;
            for (; lost_dev; lost_dev &= lost_dev - 1)
                dev_run[__builtin_ctzll(lost_dev)] = (uint32_t)i;
            alive &= any_b;
            dev &= dev_b;
            if (!alive) break;
        }
        for (uint64_t m = alive; m; m &= m - 1) any_run[__builtin_ctzll(m)] = (uint32_t)i;
        for (uint64_t m = dev; m; m &= m - 1) dev_run[__builtin_ctzll(m)] = (uint32_t)i;
        for (uint64_t m = first; m; m &= m - 1) {
            uint32_t w = (uint32_t)__builtin_ctzll(m);
            out.push_back(Result{w, any_run[w], dev_run[w]});
        }
    }

    size_t memory_bytes() const {
        size_t total = sizeof(*this) + blocks.bytes();
        total += spills.capacity() * sizeof(std::vector<Holder>);
        for (const auto &v : spills) total += v.capacity() * sizeof(Holder);
        total += free_spills.capacity() * 4 + free_workers.capacity() * 4;
        total += workers.capacity() * sizeof(Worker *) + active.capacity() * sizeof(Active);
        for (const Worker *w : workers)
            if (w) total += sizeof(Worker) + w->engine.bytes() + w->direct.bytes();
        return total;
    }
};

}  // namespace kvr

#endif
