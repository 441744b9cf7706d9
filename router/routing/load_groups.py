"""Workers grouped by the figures a price sees, and the choice made without pricing every worker.

A worker that holds none of a prompt (no index match, no predicted residency of its first
block) is priced on its wait and rates alone (:mod:`router.routing.scheduler`):
``wait + prefill(B blocks, none held) + first_s`` (and the prefill again when no worker is
idle). Two such workers with equal figures cost the
same, so :class:`LoadGroups` keeps every worker in a group keyed by those figures
(:data:`LoadKey`), updated as they change (the routing core regroups a worker whenever its
books, sessions or rates change), and the groups sorted by wait. :func:`choose_fast` prices the
workers that hold some of the prompt one by one, as :func:`router.routing.scheduler.choose`
does, and the rest once per group, in order of wait, stopping where no later group can cost
less than the best so far: a group's price is at least its wait plus the prefill of the whole
prompt at the least rates of any worker (twice, when no worker is idle). An idle fleet of one
engine kind is one group; a loaded one is priced only as far as its waits are short.

A peer fetch (:mod:`router.routing.scheduler`) is one more option per group: a worker holding
nothing fetches from a source at the default link (``sources``); a worker whose link from
some source is another (learned, backed off, or under its copy floor), or that receives no
fetches, is priced one by one with the holders (the routing core lists it among them). The
floor then counts the cheapest option at the least rates.

Exact, not approximate: the choice, its ties and the random draws that break them are those of
:func:`router.routing.scheduler.choose` over every worker
(``tests/router/routing/test_load_groups.py`` checks random states).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

from router.routing.rates import Rates
from router.routing.scheduler import (
    Candidate,
    FetchSource,
    WorkerCost,
    copy_seconds,
    cost_of,
    fetch_terms,
    prefill_seconds,
)

__all__ = ["FastChoice", "LoadGroups", "LoadKey", "choose_fast"]

#: (wait seconds, prefill_s, context_s, first_s per block, active requests, pending prefill
#: blocks, decode blocks, requests prefilling): everything a worker holding nothing is priced
#: on and shown with.
LoadKey = tuple[float, float, float, float, int, float, float, int]

# A lower bound computed in another order of operations may exceed the cost it bounds by a
# few ulps; the pruning keeps this much relative slack.
_SLACK = 1e-9


class LoadGroups:
    """Every tracked worker in the group of its :data:`LoadKey`, groups sorted by key.

    Invariants:
        1. Each tracked worker is in exactly one group, the one of its last :meth:`update`.
        2. ``_order`` holds each non-empty group's key once, sorted (wait first).
        3. ``_prefill``, ``_context`` and ``_first`` hold each tracked worker's rate once,
           sorted.
        4. ``_ids`` holds each tracked worker once, sorted.

    :func:`choose_fast` reads them through the read-only views below (the lists
    themselves, not copies: a caller must not change them).
    """

    def __init__(self) -> None:
        self._key: dict[int, LoadKey] = {}
        self._members: dict[LoadKey, list[int]] = {}  # worker ids, sorted
        self._order: list[LoadKey] = []
        self._prefill: list[float] = []
        self._context: list[float] = []
        self._first: list[float] = []
        self._ids: list[int] = []  # every tracked worker, sorted

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, worker: object) -> bool:
        return worker in self._key

    def key(self, worker: int) -> LoadKey:
        """The figures ``worker`` is priced on."""
        return self._key[worker]

    @property
    def order(self) -> Sequence[LoadKey]:
        """Each group's key once, sorted (least wait first)."""
        return self._order

    def members(self, key: LoadKey) -> list[int]:
        """The workers of the group ``key``, sorted (do not change the list)."""
        return self._members[key]

    @property
    def ids(self) -> list[int]:
        """Every tracked worker, sorted (do not change the list)."""
        return self._ids

    def least_rates(self) -> tuple[float, float, float]:
        """The least ``prefill_s``, ``context_s`` and ``first_s`` of any tracked worker (each
        may be another worker's; there must be one)."""
        return self._prefill[0], self._context[0], self._first[0]

    def update(self, worker: int, key: LoadKey) -> None:
        """Put ``worker`` in the group of ``key`` (tracking it if new)."""
        old = self._key.get(worker)
        if old == key:
            return
        # Its rates change far more rarely than its load: the sorted rates stay as they are
        # unless they do.
        same_rates = (old is not None and old[1] == key[1] and old[2] == key[2]
                      and old[3] == key[3])
        if old is not None:
            self._leave(worker, old, same_rates)
        else:
            bisect.insort(self._ids, worker)
        self._key[worker] = key
        members = self._members.get(key)
        if members is None:
            self._members[key] = [worker]
            bisect.insort(self._order, key)
        else:
            bisect.insort(members, worker)
        if not same_rates:
            bisect.insort(self._prefill, key[1])
            bisect.insort(self._context, key[2])
            bisect.insort(self._first, key[3])

    def remove(self, worker: int) -> None:
        """Stop tracking ``worker`` (a no-op for an unknown one)."""
        old = self._key.pop(worker, None)
        if old is not None:
            self._leave(worker, old)
            del self._ids[bisect.bisect_left(self._ids, worker)]

    def _leave(self, worker: int, key: LoadKey, keep_rates: bool = False) -> None:
        members = self._members[key]
        del members[bisect.bisect_left(members, worker)]
        if not members:
            del self._members[key]
            del self._order[bisect.bisect_left(self._order, key)]
        if keep_rates:
            return
        del self._prefill[bisect.bisect_left(self._prefill, key[1])]
        del self._context[bisect.bisect_left(self._context, key[2])]
        del self._first[bisect.bisect_left(self._first, key[3])]

    def groups(self) -> list[tuple[LoadKey, list[int]]]:
        """Each group's key and members (sorted ids), by wait (a snapshot)."""
        return [(k, self._members[k]) for k in self._order]


class FastChoice:
    """What :func:`choose_fast` found: the worker and its cost terms."""

    __slots__ = ("chosen", "worker")

    def __init__(self, worker: int, chosen: WorkerCost) -> None:
        self.worker = worker
        self.chosen = chosen


def choose_fast(request_blocks: int, holders: Sequence[Candidate], groups: LoadGroups,
                rng: random.Random, passed_on: float = 1.0, slo: float | None = None,
                sources: Sequence[FetchSource] = (), pressure: float = 0.0) -> FastChoice:
    """:func:`router.routing.scheduler.choose` over every worker in ``groups``, pricing one by
    one only ``holders`` (the workers that match some of the request, with their matches;
    every one of them tracked in ``groups``) and the rest once per group. ``passed_on`` is
    :attr:`~router.routing.scheduler.Candidate.passed_on` of a worker with a request
    prefilling (a group whose key counts one); the others' is 1. ``slo``: the TTFT
    objective, as :func:`~router.routing.scheduler.choose`'s. ``sources``: what every worker
    not among ``holders`` may fetch from (its :attr:`~router.routing.scheduler.Candidate.
    sources`: the default links; a worker with another is among ``holders``); ``pressure``:
    the fleet's eviction pressure, as :func:`~router.routing.scheduler.choose`'s.

    Written for a decision on cold caches (a router decides between parsing two request
    bodies), where each Python call costs microseconds: plain loops rather than
    comprehensions, and a group priced as numbers, with its :class:`WorkerCost` built only
    for the worker chosen.

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
    # A busy fleet (no tracked worker idle) prices each prefill again, as passed on (the
    # scheduler's docstring): the least wait is the first group's.
    busy = order[0][0] > 0
    objective = slo if busy else None
    priced: list[tuple[tuple[float, float, int], WorkerCost]] = []  # (rank, terms)
    best: tuple[float, float, int] = (math.inf, 0.0, 0)
    for c in holders:
        wc = cost_of(c, request_blocks, busy, objective, pressure)
        rank = wc.rank
        priced.append((rank, wc))
        if rank < best:
            best = rank
    # The rest, a group at a time, while a group could still cost no more than the best. A
    # group's price is cost_of's for a worker matching nothing (the same operations, so the
    # same float): (wait + prefill of B blocks) + first_s, plus the prefill passed on if busy
    # (at least once: the floor's); within an objective, the prefill alone.
    least_p, least_c, least_first = groups.least_rates()
    least_prefill = prefill_seconds(least_p, least_c, 0.0, request_blocks, 0, 0)
    # Each option's transfer and prefill at the least rates: the cheapest bounds a group.
    least_part, least_own, least_busy = least_prefill, least_prefill, 2.0 * least_prefill
    offers: list[FetchSource] = []
    if sources:
        least = Rates(prefill_s=least_p, context_s=least_c)
        for s in sources:
            if min(s.blocks, request_blocks) <= 0:
                continue
            offers.append(s)
            transfer, own, _ = fetch_terms(0.0, least, request_blocks, 0, 0, s)
            least_part = min(least_part, transfer + own)
            least_own = min(least_own, own)
            least_busy = min(least_busy, transfer + 2.0 * own)
    floor = (least_busy if busy else least_part) + least_first
    tied_groups: list[tuple[LoadKey, list[int], float, tuple | None]] = []
    for key in order:
        # A group within the objective is priced at least the least prefill; past the wait
        # where even the least rates' TTFT exceeds it, every later group is beyond it too.
        bound = key[0] + floor
        if objective is not None and (key[0] + least_part) + least_first <= objective + (
                _SLACK * (objective + 1.0)):
            bound = least_own
        if bound - best[0] > _SLACK * (abs(best[0]) + 1.0):
            break
        members = groups.members(key)
        if len(members) <= len(held) and all(w in held for w in members):
            continue
        prefill = prefill_seconds(key[1], key[2], 0.0, request_blocks, 0, 0)
        cost = (key[0] + prefill) + key[3]
        if objective is not None and cost <= objective:
            rank = (prefill, cost, key[4])
        elif busy:
            rank = (cost + (passed_on if key[7] else 1.0) * prefill, 0.0, key[4])
        else:
            rank = (cost, 0.0, key[4])
        fetch = None
        if offers:
            fetch = _group_fetch(key, request_blocks, busy, objective, passed_on, offers,
                                 pressure)
            if fetch[0] < rank:
                rank = fetch[0]
            else:
                fetch = (fetch[0], None, fetch[2])
        if rank < best:
            best, tied_groups = rank, [(key, members, prefill, fetch)]
        elif rank == best:
            tied_groups.append((key, members, prefill, fetch))
    tied: list[int] = []
    for rank, wc in priced:
        if rank == best:
            tied.append(wc.worker)
    runs: list[list[int]] = []
    skipped: list[int] = []  # the held workers inside the tied groups
    if len(tied_groups) == len(order):  # every group ties: one run, the fleet
        runs.append(groups.ids)
        skipped = sorted(held)
    else:
        for _, members, _, _ in tied_groups:
            runs.append(members)
        if runs and held:
            keys = {key for key, _, _, _ in tied_groups}
            skipped = sorted(w for w in held if groups.key(w) in keys)
    tied.sort()
    worker = _draw(runs, skipped, tied, rng)
    if tied and _has(tied, worker):
        for _, wc in priced:
            if wc.worker == worker:
                return FastChoice(worker, wc)
    key = groups.key(worker)
    prefill = 0.0
    fetch = None
    for group in tied_groups:
        if group[0] == key:
            prefill, fetch = group[2], group[3]
            break
    # The terms cost_of gives a worker of group ``key`` (it matches nothing).
    cost = (key[0] + prefill) + key[3]
    within = objective is not None and cost <= objective
    if within:
        priced_at = prefill
    elif busy:
        priced_at = cost + (passed_on if key[7] else 1.0) * prefill
    else:
        priced_at = cost
    chosen = WorkerCost(worker=worker, matched_blocks=0, device_matched_blocks=0,
                        prefill_blocks=request_blocks, pending_prefill_blocks=key[5],
                        decode_blocks=key[6], active_requests=key[4], wait_s=key[0],
                        prefill_s=prefill, cost=cost, price=priced_at, within_slo=within,
                        recompute_cost=cost, recompute_price=priced_at)
    if fetch is not None:
        best_fetch = fetch[2]
        chosen.best_source, chosen.fetch_cost, chosen.fetch_price = best_fetch
        if fetch[1] is not None:
            source, held_blocks, transfer, own, fcost, fwithin, fprice = fetch[1]
            chosen.fetch_source, chosen.fetch_blocks, chosen.fetch_s = (source, held_blocks,
                                                                        transfer)
            chosen.prefill_blocks, chosen.prefill_s = request_blocks - held_blocks, own
            chosen.cost, chosen.price, chosen.within_slo = fcost, fprice, fwithin
    return FastChoice(worker, chosen)


def _group_fetch(key: LoadKey, request_blocks: int, busy: bool, objective: float | None,
                 passed_on: float, sources: list[FetchSource], pressure: float) -> tuple:
    """The cheapest fetch of a worker of group ``key`` (it holds nothing): its rank, the
    option's terms, and (source, TTFT, price) of the cheapest, as
    :func:`~router.routing.scheduler.cost_of` finds them."""
    rates = Rates(prefill_s=key[1], context_s=key[2], first_s=key[3])
    n = passed_on if key[7] else 1.0
    best: tuple[float, float] | None = None
    option: tuple = ()
    for s in sources:
        transfer, own, fcost = fetch_terms(key[0], rates, request_blocks, 0, 0, s)
        if objective is not None and fcost <= objective:
            within, fprice = True, own
        elif busy:
            within, fprice = False, fcost + n * own
            if pressure:
                fprice = fcost + n * (own + pressure * copy_seconds(rates, request_blocks, 0,
                                                                    s))
        else:
            within, fprice = False, fcost
        rank = (fprice, fcost if within else 0.0)
        if best is None or rank < best:
            best = rank
            option = (s.worker, min(s.blocks, request_blocks), transfer, own, fcost, within,
                      fprice)
    assert best is not None, "a group's fetch needs a source"
    return (best[0], best[1], key[4]), option, (option[0], option[4], option[6])


def _draw(runs: list[list[int]], skipped: list[int], extra: list[int],
          rng: random.Random) -> int:
    """``rng.choice`` over the sorted union of ``extra`` and the ``runs``' members less
    ``skipped`` (the draw consumed exactly as over that list), without building it: groups
    that tie with each other can hold most of the fleet.

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
