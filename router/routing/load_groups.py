"""Workers grouped by the load a cost sees, and the choice made without pricing every worker.

A worker that holds none of a prompt (no index match, no predicted residency of its first
block) is priced on its load alone: pending prefill, decode blocks, active requests and live
sessions. Two such workers with equal
figures cost the same, so :class:`LoadGroups` keeps every worker in a group keyed by those
figures, updated as they change (the load books and the session tracker call back), and the
groups sorted by pending prefill. :func:`choose_fast` prices the workers that hold some of the
prompt one by one, as :func:`router.routing.scheduler.choose` does, and the rest once per group, in
order of pending prefill, stopping where no later group can cost less than the best so far:
a group's cost is at least ``weight * (B + queue_weight * pending)`` plus the least decode
load of any worker (the session term is never negative). An idle fleet is one group; a
loaded one is priced only as far as its queues are short.

Exact, not approximate: the choice, its ties and the random draws that break them are those of
:func:`router.routing.scheduler.choose` over every worker
(``tests/router/routing/test_load_groups.py`` checks random states).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

from router.routing.scheduler import Candidate, SchedulerConfig, WorkerCost, cost_of, stays_home

__all__ = ["FastChoice", "LoadGroups", "LoadKey", "choose_fast"]

#: (pending prefill, decode, active requests, live sessions).
LoadKey = tuple[float, float, int, float]

# A lower bound computed in another order of operations may exceed the cost it bounds by a
# few ulps; the pruning keeps this much relative slack.
_SLACK = 1e-9


class LoadGroups:
    """Every tracked worker in the group of its :data:`LoadKey`, groups sorted by key.

    Invariants:
        1. Each tracked worker is in exactly one group, the one of its last :meth:`update`.
        2. ``_order`` holds each non-empty group's key once, sorted (pending prefill first).
        3. ``_decode`` and ``_sessions`` hold each tracked worker's figure once, sorted.
        4. ``_ids`` holds each tracked worker once, sorted.

    :func:`choose_fast` reads them through the read-only views below (the lists
    themselves, not copies: a caller must not change them).
    """

    def __init__(self) -> None:
        self._key: dict[int, LoadKey] = {}
        self._members: dict[LoadKey, list[int]] = {}  # worker ids, sorted
        self._order: list[LoadKey] = []
        self._decode: list[float] = []
        self._sessions: list[float] = []
        self._ids: list[int] = []  # every tracked worker, sorted

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, worker: object) -> bool:
        return worker in self._key

    def key(self, worker: int) -> LoadKey:
        """The figures ``worker`` is priced on."""
        return self._key[worker]

    def key_of(self, worker: int) -> LoadKey | None:
        """The figures ``worker`` is priced on; None when it is not tracked."""
        return self._key.get(worker)

    @property
    def order(self) -> Sequence[LoadKey]:
        """Each group's key once, sorted (least pending prefill first)."""
        return self._order

    def members(self, key: LoadKey) -> list[int]:
        """The workers of the group ``key``, sorted (do not change the list)."""
        return self._members[key]

    @property
    def ids(self) -> list[int]:
        """Every tracked worker, sorted (do not change the list)."""
        return self._ids

    @property
    def least_decode(self) -> float:
        """The least decode load of any tracked worker (there must be one)."""
        return self._decode[0]

    @property
    def fewest_sessions(self) -> float:
        """The fewest live sessions of any tracked worker (there must be one)."""
        return self._sessions[0]

    def update(self, worker: int, key: LoadKey) -> None:
        """Put ``worker`` in the group of ``key`` (tracking it if new)."""
        old = self._key.get(worker)
        if old == key:
            return
        if old is not None:
            self._leave(worker, old)
        else:
            bisect.insort(self._ids, worker)
        self._key[worker] = key
        members = self._members.get(key)
        if members is None:
            self._members[key] = [worker]
            bisect.insort(self._order, key)
        else:
            bisect.insort(members, worker)
        bisect.insort(self._decode, key[1])
        bisect.insort(self._sessions, key[3])

    def remove(self, worker: int) -> None:
        """Stop tracking ``worker`` (a no-op for an unknown one)."""
        old = self._key.pop(worker, None)
        if old is not None:
            self._leave(worker, old)
            del self._ids[bisect.bisect_left(self._ids, worker)]

    def _leave(self, worker: int, key: LoadKey) -> None:
        members = self._members[key]
        del members[bisect.bisect_left(members, worker)]
        if not members:
            del self._members[key]
            del self._order[bisect.bisect_left(self._order, key)]
        del self._decode[bisect.bisect_left(self._decode, key[1])]
        del self._sessions[bisect.bisect_left(self._sessions, key[3])]

    def groups(self) -> list[tuple[LoadKey, list[int]]]:
        """Each group's key and members (sorted ids), by pending prefill (a snapshot)."""
        return [(k, self._members[k]) for k in self._order]


def candidate_of(worker: int, key: LoadKey, matched: int = 0, device: int = 0) -> Candidate:
    """The scheduler's view of a worker with these load figures."""
    return Candidate(worker=worker, matched_blocks=matched, device_matched_blocks=device,
                     pending_prefill_blocks=key[0], decode_blocks=key[1],
                     active_requests=key[2], sessions=key[3])


class FastChoice:
    """What :func:`choose_fast` found: the worker, its cost terms, the weight they were
    priced at, and whether it stayed home."""

    __slots__ = ("chosen", "overlap_weight", "stayed", "worker")

    def __init__(self, worker: int, chosen: WorkerCost, overlap_weight: float,
                 stayed: bool) -> None:
        self.worker = worker
        self.chosen = chosen
        self.overlap_weight = overlap_weight
        self.stayed = stayed


def choose_fast(request_blocks: int, holders: Sequence[Candidate], groups: LoadGroups,
                config: SchedulerConfig, rng: random.Random, home: int | None = None,
                continue_rate: float = 1.0) -> FastChoice:
    """:func:`router.routing.scheduler.choose` over every worker in ``groups``, pricing one by one
    only ``holders`` (the workers that match some of the request, with their matches; every
    one of them tracked in ``groups``) and the rest once per group.

    Written for a decision on cold caches (a router decides between parsing two request
    bodies), where each Python call costs microseconds: plain loops rather than
    comprehensions, the groups' lists read in place, and a group priced as numbers, with its
    :class:`WorkerCost` built only for the worker chosen.

    Raises:
        ValueError: no tracked worker, or a negative block count.
    """
    if not len(groups):
        raise ValueError("no candidate workers")
    if request_blocks < 0:
        raise ValueError(f"request_blocks must be >= 0, got {request_blocks}")
    held: dict[int, Candidate] = {}
    for c in holders:
        held[c.worker] = c
    order = groups.order
    home_key = groups.key_of(home) if home is not None else None
    if home is not None and home_key is not None and stays_home(home_key[0], order[0][0],
                                                                config):
        c = held.get(home) or candidate_of(home, home_key)
        return FastChoice(home, cost_of(c, request_blocks, config), config.overlap_weight,
                          True)
    session_price = fewest = 0.0
    sessions = config.session_weight > 0
    if sessions:
        fewest = groups.fewest_sessions
        session_price = config.overlap_weight * (config.session_weight * continue_rate)
    priced: list[WorkerCost] = []
    best = (math.inf, 0)
    for c in holders:
        wc = cost_of(c, request_blocks, config)
        if sessions:
            wc.cost += session_price * (wc.sessions - fewest)
        priced.append(wc)
        rank = (wc.cost, wc.active_requests)
        if rank < best:
            best = rank
    # The rest, a group at a time, while a group could still cost no more than the best. A
    # group's cost is cost_of's for a worker matching nothing (the same operations, so the
    # same float): weight * (B + queue_weight * pending) + decode, plus the session term.
    factor = config.queue_weight
    weight = config.overlap_weight
    floor = groups.least_decode
    tied_groups: list[tuple[LoadKey, list[int], float]] = []  # key, members, prefill
    for key in order:
        prefill = request_blocks + factor * key[0]
        if weight * prefill + floor - best[0] > _SLACK * (abs(best[0]) + 1.0):
            break
        members = groups.members(key)
        if len(members) <= len(held) and all(w in held for w in members):
            continue
        cost = weight * prefill + key[1]
        if sessions:
            cost += session_price * (key[3] - fewest)
        rank = (cost, key[2])
        if rank < best:
            best, tied_groups = rank, [(key, members, prefill)]
        elif rank == best:
            tied_groups.append((key, members, prefill))
    tied: list[int] = []
    for wc in priced:
        if (wc.cost, wc.active_requests) == best:
            tied.append(wc.worker)
    runs: list[list[int]] = []
    skipped: list[int] = []  # the held workers inside the tied groups
    if len(tied_groups) == len(order):  # every group ties: one run, the fleet
        runs.append(groups.ids)
        skipped = sorted(held)
    else:
        for _, members, _ in tied_groups:
            runs.append(members)
        if runs and held:
            keys = {key for key, _, _ in tied_groups}
            skipped = sorted(w for w in held if groups.key(w) in keys)
    tied.sort()
    worker = _draw(runs, skipped, tied, rng)
    if tied and _has(tied, worker):
        for wc in priced:
            if wc.worker == worker:
                return FastChoice(worker, wc, weight, False)
    key = groups.key(worker)
    prefill = 0.0
    for group in tied_groups:
        if group[0] == key:
            prefill = group[2]
            break
    # The terms cost_of gives a worker of group ``key`` (it matches nothing); best[0] is the
    # cost, session term included.
    chosen = WorkerCost(worker=worker, matched_blocks=0, device_matched_blocks=0,
                        credited_blocks=0.0, prefill_blocks=prefill, decode_blocks=key[1],
                        active_requests=key[2], cost=best[0], sessions=key[3])
    return FastChoice(worker, chosen, weight, False)


def _draw(runs: list[list[int]], skipped: list[int], extra: list[int],
          rng: random.Random) -> int:
    """``rng.choice`` over the sorted union of ``extra`` and the ``runs``' members less
    ``skipped`` (the draw consumed exactly as over that list), without building it: groups
    that tie with each other (say, on an idle fleet whose workers differ only in live
    sessions, while sessions cost nothing) hold most of the fleet.

    ``runs`` and ``extra`` are sorted lists of worker ids, disjoint from each other;
    ``skipped`` is sorted and each of its ids is in some run.
    """
    count = len(extra) - len(skipped)
    for run in runs:
        count += len(run)
    if not skipped and not extra and len(runs) == 1:  # one group: index it
        members = runs[0]
        return members[0] if count == 1 else members[rng.choice(range(count))]
    index = 0 if count == 1 else rng.choice(range(count))
    if not runs:
        return extra[index]
    # The least id with more than ``index`` ids at or below it, by bisection on the id.
    lo = min([r[0] for r in runs] + extra[:1])
    hi = max([r[-1] for r in runs] + extra[-1:])
    while lo < hi:
        mid = (lo + hi) // 2
        at_or_below = bisect.bisect_right(extra, mid) - bisect.bisect_right(skipped, mid)
        for run in runs:
            at_or_below += bisect.bisect_right(run, mid)
        if at_or_below > index:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _has(members: list[int], worker: int) -> bool:
    i = bisect.bisect_left(members, worker)
    return i < len(members) and members[i] == worker
