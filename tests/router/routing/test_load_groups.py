"""The fast choice against the specification: random fleets, random load, random requests;
:func:`router.routing.load_groups.choose_fast` (holders one by one, the rest by load group)
must pick what :func:`router.routing.scheduler.choose` picks over every worker, with the same
cost terms and the same random draws."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest

from indexer.events import Stored
from router.routing.core import CoreSettings, RoutingCore
from router.routing.fetch_links import FetchAbility
from router.routing.load import ReportedLoad
from router.routing.load_groups import LoadGroups, choose_fast
from router.routing.rates import Rates
from router.routing.scheduler import Candidate, choose

#: Engine kinds of different speeds (a fleet mixes them).
KINDS = {"kvroute": Rates(prefill_s=2e-6, context_s=4e-10, decode_s=2e-8, onboard_s=6e-7,
                          first_s=0.008),
         "slow": Rates(prefill_s=8e-6, context_s=1e-9, decode_s=5e-8, onboard_s=1e-6,
                       first_s=0.02)}


#: Peer fetch abilities a random fleet mixes: most serve and receive, some only one, some
#: neither (a stock engine); KV of a small, a large and an absurd model a token.
ABILITIES = [FetchAbility(True, True, 32768)] * 4 + [
    FetchAbility(True, True, 1 << 20), FetchAbility(True, False, 32768),
    FetchAbility(False, True, 32768), None,
    # CUDA IPC peers of two GPUs: their pairs are priced at the IPC path's bandwidth.
    FetchAbility(True, True, 32768, ("h", "GPU-0")),
    FetchAbility(True, True, 32768, ("h", "GPU-0")),
    FetchAbility(True, False, 32768, ("h", "GPU-0")),
    FetchAbility(True, True, 32768, ("h", "GPU-1")),
    # HTTP fetches slower than some default links (a torch worker's 0.25 GB/s, 2 GB/s):
    # a pair is priced at its slower end.
    FetchAbility(True, True, 32768, None, 0.25e9), FetchAbility(True, True, 32768, None, 2e9),
    FetchAbility(True, False, 32768, None, 2e9), FetchAbility(False, True, 32768, None, 0.25e9)]
#: Default links: slow, the default, and one faster than a host copy (the copy floor).
BANDWIDTHS = (1e9, 25e9, 1e13)


def _fleet(rng: random.Random, workers: int, learn: bool = True,
           slo: float | None = None, fetch: bool = False) -> RoutingCore:
    core = RoutingCore(CoreSettings(learn=learn, ttft_slo=slo,
                                    fetch_bandwidth=rng.choice(BANDWIDTHS)))
    mixed = rng.random() < 0.5
    for w in range(workers):
        engine = rng.choice(["kvroute", "vllm"]) if mixed else "kvroute"
        core.worker_joined(w, engine=engine, approximate=rng.random() < 0.2,
                           fetch=rng.choice(ABILITIES) if fetch else None)
    return core


def _agree(core: RoutingCore, rng: random.Random, hashes: list[int],
           matches: dict[int, tuple[int, int]], now: float) -> None:
    seed = rng.random()
    fast_rng, full_rng = random.Random(seed), random.Random(seed)
    passed_on = core.passed_on()
    slo = core.settings.ttft_slo
    sources = core._sources(matches, None, len(hashes))
    pressure = core.fetch_pressure(now)
    fast = choose_fast(len(hashes), core._holders(hashes, matches, now, passed_on, sources),
                       core._groups, fast_rng, passed_on, slo, sources, pressure)
    full = choose(len(hashes), core.candidates(range(len(core._groups)), hashes, matches, now),
                  full_rng, slo, pressure)
    assert fast.worker == full.worker
    assert fast.chosen == full.chosen
    assert fast_rng.getstate() == full_rng.getstate()
    FETCHES.add(full.chosen.fetch_source is not None)


#: Whether each decision of the differential runs chose a fetch (the runs must meet both).
FETCHES: set[bool] = set()


def _step(core: RoutingCore, rng: random.Random, step: int, workers: int,
          prefixes: list[list[int]], in_flight: list[str], differential: bool = True) -> None:
    """One random request decided both ways (``differential``; else only the draw
    :func:`_agree` makes, which leaves the fleet to move exactly as when it decides), then
    the fleet moved: routed, first tokens (which teach rates), ends, reports, clears."""
    now = step * 0.05
    hashes = list(rng.choice(prefixes))[: rng.randrange(0, 12)] + [
        rng.getrandbits(32) for _ in range(rng.randrange(0, 4))]
    matches = {w: (m, rng.randint(0, m)) for w in rng.sample(range(workers),
                                                              rng.randint(0, workers))
               for m in [rng.randint(0, len(hashes))] if m}
    if differential:
        _agree(core, rng, hashes, matches, now)
    else:
        rng.random()
    routed = core.decide(hashes, matches, now, rng)
    rid = f"r{step}"
    core.routed(rid, routed.decision.worker, hashes, routed.decision.chosen, now,
                routed.continued, len(hashes) * 32 + rng.randrange(2))
    in_flight.append(rid)
    chosen = routed.decision.chosen
    if chosen.fetch_source is not None and rng.random() < 0.7:  # its answer, some day
        core.fetch_answered(rid, rng.choice([None, 0, chosen.fetch_blocks]))
    if rng.random() < 0.2:  # some fetch's stores, or a prefill's
        core.events_applied(rng.randrange(workers), [Stored(
            block_hashes=[rng.getrandbits(32) for _ in range(n)], parent_block_hash=None,
            token_ids=[1] * (32 * n), block_size=32) for n in [rng.randint(1, 12)]], now)
    for r in rng.sample(in_flight, min(len(in_flight), rng.randint(0, 2))):
        core.first_token(r, now + rng.random())
    if in_flight and rng.random() < 0.4:
        core.finished(in_flight.pop(rng.randrange(len(in_flight))))
    if rng.random() < 0.05:
        core.load_reported(rng.randrange(workers), ReportedLoad(
            rng.randint(0, 9), rng.randint(0, 9), float(rng.randint(0, 50)),
            float(rng.randint(0, 50))))
    if rng.random() < 0.05:
        core.cache_cleared(rng.randrange(workers), now)
    if rng.random() < 0.1:  # caches turning over: a busy fleet prices a fetched copy
        core.record_resident(rng.randrange(workers), rng.randint(0, 40), rng.randint(0, 30),
                             now)
    pair = None
    if chosen.fetch_source is not None and rng.random() < 0.5:  # its result, learned
        pair = (chosen.fetch_source, chosen.worker)
    elif workers > 1 and rng.random() < 0.3:  # another router's fetch, say
        pair = (rng.randrange(workers), rng.randrange(workers))
    if pair is not None:
        if rng.random() < 0.3:
            core.fetch_failed(*pair, now)
        else:
            core.fetched(*pair, rng.uniform(1e5, 1e8), rng.uniform(1e-4, 0.5))


#: TTFT objectives about the random fleets' predicted TTFTs (8-20 ms): some candidates are
#: within, some beyond.
OBJECTIVES = (0.0082, 0.0086, 0.009, 0.01, 0.02)


def _random_run(seed: int, before_step: Callable[[RoutingCore], None] | None = None,
                slo: bool = False, fetch: bool = False, differential: bool = True) -> None:
    """300 random requests on a random fleet of ``seed``, each decided both ways (``_step``;
    ``differential`` off: the same fleet's moves without the second decision, for a test
    that looks at the fleets the differential tests meet); ``before_step`` sees the core
    before each; ``slo``: under a random TTFT objective; ``fetch``: workers advertise peer
    fetch (:data:`ABILITIES`)."""
    rng = random.Random(seed)
    workers = rng.choice([1, 2, 3, 8, 24])
    core = _fleet(rng, workers, learn=seed % 3 != 0,
                  slo=rng.choice(OBJECTIVES) if slo else None, fetch=fetch)
    prefixes = [[rng.getrandbits(32) for _ in range(rng.randrange(1, 12))] for _ in range(5)]
    in_flight: list[str] = []
    for step in range(300):
        if before_step is not None:
            before_step(core)
        _step(core, rng, step, workers, prefixes, in_flight, differential)


@pytest.mark.parametrize("seed", range(12))
def test_the_fast_choice_is_the_full_scans(seed: int) -> None:
    _random_run(seed)


@pytest.mark.parametrize("seed", range(12))
def test_under_a_ttft_objective_the_fast_choice_is_the_full_scans(seed: int) -> None:
    _random_run(seed, slo=True)


@pytest.mark.parametrize("seed", range(12))
def test_with_peer_fetch_the_fast_choice_is_the_full_scans(seed: int) -> None:
    _random_run(seed, fetch=True)
    _random_run(seed + 100, slo=True, fetch=True)


def test_the_fetch_runs_choose_fetches_and_recomputes() -> None:
    FETCHES.clear()
    for seed in range(6):
        _random_run(seed, fetch=True)
    assert sorted(FETCHES) == [False, True]


def test_the_objective_runs_choose_within_and_beyond_it() -> None:
    # In a busy fleet the objective prices a candidate within it otherwise: the runs above
    # must meet busy fleets whose least-cost worker is within it and ones where none is.
    seen: set[bool] = set()

    def look(core: RoutingCore) -> None:
        if core._groups.order[0][0] > 0:
            routed = core.decide([1, 2, 3], {}, 0.0, random.Random(0))
            seen.add(routed.decision.chosen.within_slo)

    for seed in range(12):  # the runs of test_under_a_ttft_objective_...
        _random_run(seed, look, slo=True, differential=False)
    assert seen == {True, False}


def test_hand_set_rates_agree_too() -> None:
    rng = random.Random(5)
    core = RoutingCore(CoreSettings(rates=KINDS["slow"]))
    for w in range(6):
        core.worker_joined(w)
    prefixes = [[rng.getrandbits(32) for _ in range(8)] for _ in range(3)]
    in_flight: list[str] = []
    for step in range(200):
        _step(core, rng, step, 6, prefixes, in_flight)
    assert all(core.rate_factor(w) == 1.0 for w in range(6))  # hand-set: nothing learned


def test_an_idle_fleet_is_one_group_and_ties_draw_as_the_scan_does() -> None:
    core = RoutingCore(CoreSettings())
    for w in range(64):
        core.worker_joined(w)
    assert len(core._groups.groups()) == 1
    for seed in range(20):
        rng = random.Random(seed)
        hashes = [rng.getrandbits(32) for _ in range(10)]
        matches = {rng.randrange(64): (2, 2)} if seed % 2 else {}
        _agree(core, rng, hashes, matches, 0.0)


def test_holders_on_the_host_tier_draw_as_the_scan_does() -> None:
    """Holders matching on the host tier only, at an onboarding cost equal to a recompute:
    they tie with their group (the draw leaves them out of the group and takes them in one
    by one); at a cheaper copy they win."""
    for onboard in (2e-6, 6e-7):
        rates = dataclasses.replace(KINDS["kvroute"], onboard_s=onboard)
        core = RoutingCore(CoreSettings(rates=rates))
        for w in range(96):
            core.worker_joined(w)
        for seed in range(20):
            draw = random.Random(seed)
            hashes = [draw.getrandbits(32) for _ in range(6)]
            held = draw.sample(range(96), draw.choice([0, 1, 5, 30]))
            _agree(core, draw, hashes, {w: (draw.choice([1, 6]), 0) for w in held}, 0.0)


def test_the_groups_follow_the_books() -> None:
    rng = random.Random(3)
    core = _fleet(rng, 10)
    for i in range(200):
        w = rng.randrange(10)
        hashes = [rng.getrandbits(32) for _ in range(rng.randint(1, 5))]
        routed = core.decide(hashes, {}, 0.0, rng, workers=[w])
        core.routed(f"r{i}", w, hashes, routed.decision.chosen, 0.0)
        if rng.random() < 0.5:
            core.first_token(f"r{rng.randrange(i + 1)}", rng.random())
        if rng.random() < 0.3:
            core.finished(f"r{rng.randrange(i + 1)}")
    for w in range(10):
        assert core._groups.key(w) == core._key(w)
    core.worker_left(4)
    assert 4 not in core._groups and len(core._groups) == 9
    assert core._groups.ids == [0, 1, 2, 3, 5, 6, 7, 8, 9]


def test_an_empty_fleet_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        choose_fast(1, [], LoadGroups(), random.Random(0))


@pytest.mark.parametrize("seed", range(6))
def test_cuda_ipc_peers_of_a_source_are_priced_on_their_own_link(seed: int) -> None:
    # A 1 GB/s default link (a fetch of 400 blocks: 0.4 s, dearer than recomputing them),
    # six workers, 0-2 on one GPU and 3-5 on another, each holder of a long prompt busy. A
    # worker holding nothing on its holder's GPU fetches over CUDA IPC (20 us a block, the
    # copy floor), one elsewhere at the default link: the groups' one default link would
    # misprice the first, so the fast path prices it on its own, as the scan does.
    rng = random.Random(seed)
    core = RoutingCore(CoreSettings(fetch_bandwidth=1e9))
    for w in range(6):
        core.worker_joined(w, fetch=FetchAbility(True, True, 32768, ("h", f"GPU-{w // 3}")))
    prompts = [[rng.getrandbits(32) for _ in range(rng.randint(300, 500))] for _ in range(3)]
    for i, prompt in enumerate(prompts):
        holder = rng.randrange(6)
        busy = [rng.getrandbits(32) for _ in range(2000)]
        core.routed(f"busy{i}", holder, busy, core.decide(busy, {}, 0.0, rng, workers=[
            holder], fetch=False).decision.chosen, 0.0)
        matches = {holder: (len(prompt) - 8, len(prompt) - 8)}
        _agree(core, rng, prompt, matches, 0.1)
        chosen = core.decide(prompt, matches, 0.1, random.Random(0)).decision.chosen
        assert chosen.fetch_source == holder and chosen.worker // 3 == holder // 3


@pytest.mark.parametrize("seed", range(4))
def test_a_pair_is_priced_at_its_slower_ends_http_fetches(seed: int) -> None:
    # The default link is 25 GB/s: 400 blocks of 1 MiB take 17 ms over it, 1.7 s over a
    # torch worker's 0.25 GB/s. The holder is busy; the other workers are idle and free.
    # Every worker advertising the slow path: recomputing (400 blocks, well under a second)
    # beats the fetch. Only the receiver advertising it: the same. Nobody advertising it:
    # the fetch wins.
    rng = random.Random(seed)
    prompt = [rng.getrandbits(32) for _ in range(rng.randint(400, 450))]
    for slow, fetched in (({0, 1, 2, 3}, False), ({1, 2, 3}, False), (set(), True)):
        core = RoutingCore(CoreSettings(fetch_bandwidth=25e9))
        for w in range(4):
            core.worker_joined(w, fetch=FetchAbility(True, True, 32768, None,
                                                     0.25e9 if w in slow else 0.0))
        busy = [rng.getrandbits(32) for _ in range(4000)]
        core.routed("busy", 0, busy, core.decide(busy, {}, 0.0, rng, workers=[0],
                                                 fetch=False).decision.chosen, 0.0)
        matches = {0: (len(prompt) - 8, len(prompt) - 8)}
        _agree(core, rng, prompt, matches, 0.1)
        chosen = core.decide(prompt, matches, 0.1, random.Random(0)).decision.chosen
        assert (chosen.fetch_source is not None) == fetched, (slow, chosen)
        assert core.fetch_link_s(0, 1) == pytest.approx(
            32 * 32768 / (0.25e9 if slow else 25e9))


def test_a_fleet_with_a_worker_left_out_is_priced_in_full() -> None:
    core = _fleet(random.Random(0), 4)
    routed = core.decide([1, 2, 3], {}, 0.0, random.Random(0), workers=[0, 2])
    assert routed.decision.worker in (0, 2)
    assert {c.worker for c in routed.decision.costs} == {0, 2}


def test_a_lazy_explanation_lists_every_worker_cheapest_first() -> None:
    core = _fleet(random.Random(0), 5)
    busy = list(range(100, 160))
    core.routed("busy", 3, busy, core.decide(busy, {}, 0.0, random.Random(0),
                                             workers=[3]).decision.chosen, 0.0)
    routed = core.decide([7, 8], {3: (2, 2)}, 0.0, random.Random(0))
    costs = routed.decision.costs
    assert sorted(c.worker for c in costs) == list(range(5))
    assert [c.cost for c in costs] == sorted(c.cost for c in costs)
    assert routed.decision.chosen.cost == costs[0].cost
    assert dataclasses.asdict(routed.decision.chosen)["worker"] == routed.decision.worker
    assert costs[-1].worker == 3 and costs[-1].wait_s > 0  # the queue is priced in seconds


def test_the_random_fleets_cover_busy_and_idle_fleets() -> None:
    # The price differs when no worker is idle (the prefill passed on): the differential
    # runs above must meet both kinds of fleet.
    seen: set[bool] = set()
    for seed in range(12):  # the runs of test_the_fast_choice_is_the_full_scans
        _random_run(seed, lambda core: seen.add(core._groups.order[0][0] > 0),
                    differential=False)
    assert seen == {True, False}


def test_least_rates_follow_rate_changes_not_load_changes() -> None:
    """A worker regrouped on its load alone keeps its rates in the sorted rates once; one
    regrouped on new rates moves there, and the old rates leave with it."""
    rng = random.Random(7)
    groups = LoadGroups()
    keys: dict[int, tuple[float, float, float, float, int, float, float]] = {}
    for step in range(2000):
        w = rng.randrange(6)
        if w in keys and rng.random() < 0.1:
            groups.remove(w)
            del keys[w]
            continue
        old = keys.get(w)
        if old is not None and rng.random() < 0.8:  # its load moved, its rates did not
            key = (rng.random(), *old[1:4], rng.randrange(4), float(rng.randrange(9)), 0.0)
        else:
            key = (rng.random(), rng.choice([2e-6, 3e-6, 8e-6]), rng.choice([4e-10, 1e-9]),
                   rng.choice([0.008, 0.02]), rng.randrange(4), 0.0, 0.0)
        groups.update(w, key)
        keys[w] = key
        if keys:
            assert groups.least_rates() == (min(k[1] for k in keys.values()),
                                            min(k[2] for k in keys.values()),
                                            min(k[3] for k in keys.values())), step
        assert len(groups._prefill) == len(groups._first) == len(keys)


def test_under_an_objective_a_faster_kind_further_down_the_waits_is_still_priced() -> None:
    """Within the objective a worker is priced by its prefill, not its wait: a faster engine
    kind queued longer than a slower one is reached and wins by its shorter prefill, as the
    full scan has it."""
    slow = Rates(prefill_s=4e-4, first_s=0.01)  # per block
    fast = Rates(prefill_s=1e-4, first_s=0.01)
    fleet = [(0, 0.05, slow), (1, 0.5, fast), (2, 3.0, fast)]
    groups = LoadGroups()
    for w, wait, r in fleet:
        groups.update(w, (wait, r.prefill_s, r.context_s, r.first_s, 1, 0.0, 0.0, 1))
    candidates = [Candidate(w, wait_s=wait, rates=r, active_requests=1) for w, wait, r in fleet]
    for slo in (None, 0.5, 1.0):
        fast_choice = choose_fast(1000, [], groups, random.Random(0), 1.0, slo)
        full = choose(1000, candidates, random.Random(0), slo)
        assert fast_choice.worker == full.worker
        assert fast_choice.chosen == full.chosen
    # Within 1 s both of the first two are; the fast kind's 0.1 s of prefill wins over the
    # slow one's 0.4 s, though its TTFT (0.61 s) is later (0.46 s). Within 0.5 s only the
    # first is.
    assert choose_fast(1000, [], groups, random.Random(0), 1.0, 1.0).worker == 1
    assert choose_fast(1000, [], groups, random.Random(0), 1.0, 0.5).worker == 0
