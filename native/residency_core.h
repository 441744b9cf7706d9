/* One worker's predicted blocks for the compiled PredictedResidency: block hash -> expiry, in
 * the order they were last predicted (router/routing/residency.py, the specification, keeps
 * an OrderedDict; this is the same record with no Python object per block).
 *
 * A doubly linked list gives the order (the front is the oldest prediction), a hash map the
 * lookup. set() moves a block to the back, as OrderedDict's assignment plus move_to_end
 * does; lower() changes an expiry in place, as assignment to an existing key does.
 */
#ifndef KVROUTE_RESIDENCY_CORE_H
#define KVROUTE_RESIDENCY_CORE_H

#include <stdint.h>

#include <list>
#include <unordered_map>
#include <utility>

namespace kvr {

struct Predictions {
    typedef std::pair<uint64_t, double> Slot;
    std::list<Slot> order;
    std::unordered_map<uint64_t, std::list<Slot>::iterator> at;

    size_t size() const { return order.size(); }

    /* The expiry of `h`, 0 when absent. */
    double get(uint64_t h) const {
        auto it = at.find(h);
        return it == at.end() ? 0.0 : it->second->second;
    }

    /* Whether `h` is there; its expiry in `out` when it is. */
    bool find(uint64_t h, double *out) const {
        auto it = at.find(h);
        if (it == at.end()) return false;
        *out = it->second->second;
        return true;
    }

    /* `h` expires at `expiry`, and is now the newest prediction. */
    void set(uint64_t h, double expiry) {
        auto it = at.find(h);
        if (it != at.end()) {
            it->second->second = expiry;
            order.splice(order.end(), order, it->second);
            return;
        }
        order.emplace_back(h, expiry);
        at.emplace(h, std::prev(order.end()));
    }

    /* Lower `h`'s expiry to `until` if it is later, keeping its place. */
    void lower(uint64_t h, double until) {
        auto it = at.find(h);
        if (it != at.end() && it->second->second > until) it->second->second = until;
    }

    /* Drop `h`; whether it was there. */
    bool erase(uint64_t h) {
        auto it = at.find(h);
        if (it == at.end()) return false;
        order.erase(it->second);
        at.erase(it);
        return true;
    }

    const Slot &front() const { return order.front(); }

    void pop_front() {
        at.erase(order.front().first);
        order.pop_front();
    }
};

}  // namespace kvr

#endif
