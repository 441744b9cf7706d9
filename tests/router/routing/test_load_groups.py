"""The fast choice against the specification: random fleets, random load, random requests;
:func:`router.routing.load_groups.choose_fast` (holders one by one, the rest by load group)
must pick what :func:`router.routing.scheduler.choose` picks over every worker, with the same
cost terms and the same random draws."""

from __future__ import annotations

import dataclasses
import random

import pytest

from router.routing.core import CoreSettings, RoutingCore
from router.routing.load import ReportedLoad
from router.routing.load_groups import LoadGroups, choose_fast
from router.routing.scheduler import SchedulerConfig, choose


def _config(rng: random.Random) -> SchedulerConfig:
    return SchedulerConfig(
        overlap_weight=rng.choice([1.0, 4.0, 32.0]),
        queue_weight=rng.choice([0.1, 0.25, 0.5, 1.0, 1.5]),
        session_weight=rng.choice([0.0, 16.0]),
        session_queue_blocks=rng.choice([0.0, 10.0, 128.0]),
    )


def _fleet(rng: random.Random, workers: int) -> tuple[RoutingCore, dict[int, bool]]:
    approximate = {w: rng.random() < 0.2 for w in range(workers)}
    core = RoutingCore(CoreSettings(auto_queue=False))
    for w in range(workers):
        core.worker_joined(w, approximate=approximate[w])
    return core, approximate


def _agree(core: RoutingCore, rng: random.Random, hashes: list[int],
           matches: dict[int, tuple[int, int]], now: float, config: SchedulerConfig,
           home: int | None, rate: float) -> None:
    seed = rng.random()
    fast_rng, full_rng = random.Random(seed), random.Random(seed)
    fast = choose_fast(len(hashes), core._holders(hashes, matches, now), core._groups, config,
                       fast_rng, home, rate)
    full = choose(len(hashes), core.candidates(range(len(core._groups)), hashes, matches, now),
                  config, full_rng, home, rate)
    assert fast.worker == full.worker
    assert fast.chosen == full.chosen
    assert fast.overlap_weight == full.overlap_weight
    assert fast_rng.getstate() == full_rng.getstate()


@pytest.mark.parametrize("seed", range(12))
def test_the_fast_choice_is_the_full_scans(seed: int) -> None:
    rng = random.Random(seed)
    core, _ = _fleet(rng, rng.choice([1, 2, 3, 8, 24]))
    workers = len(core._groups)
    prefixes = [[rng.getrandbits(32) for _ in range(rng.randrange(1, 12))] for _ in range(5)]
    in_flight: list[str] = []
    for step in range(300):
        now = step * 0.05
        hashes = list(rng.choice(prefixes))[: rng.randrange(0, 12)] + [
            rng.getrandbits(32) for _ in range(rng.randrange(0, 4))]
        matches = {w: (m, rng.randint(0, m)) for w in rng.sample(range(workers),
                                                                  rng.randint(0, workers))
                   for m in [rng.randint(0, len(hashes))] if m}
        config = _config(rng)
        home = rng.randrange(workers) if rng.random() < 0.3 else None
        _agree(core, rng, hashes, matches, now, config, home, rng.choice([0.0, 0.5, 1.0]))
        # Move the fleet: route (with sessions), first tokens, ends, reports.
        routed = core.decide(hashes, matches, now, rng)
        rid = f"r{step}"
        core.routed(rid, routed.decision.worker, hashes,
                    core.credited(routed.decision, routed.decision.worker), now,
                    routed.continued, len(hashes) * 32 + rng.randrange(2))
        in_flight.append(rid)
        for r in rng.sample(in_flight, min(len(in_flight), rng.randint(0, 2))):
            core.first_token(r)
        if in_flight and rng.random() < 0.4:
            core.finished(in_flight.pop(rng.randrange(len(in_flight))))
        if rng.random() < 0.05:
            core.load_reported(rng.randrange(workers), ReportedLoad(
                rng.randint(0, 9), rng.randint(0, 9), float(rng.randint(0, 50)),
                float(rng.randint(0, 50))))
        if rng.random() < 0.05:
            core.cache_cleared(rng.randrange(workers), now)


def test_an_idle_fleet_is_one_group_and_ties_draw_as_the_scan_does() -> None:
    core, _ = _fleet(random.Random(1), 64)
    assert len(core._groups.groups()) == 1
    config = SchedulerConfig()
    for seed in range(20):
        rng = random.Random(seed)
        hashes = [rng.getrandbits(32) for _ in range(10)]
        matches = {rng.randrange(64): (2, 2)} if seed % 2 else {}
        _agree(core, rng, hashes, matches, 0.0, config, None, 1.0)


def test_groups_that_differ_only_in_free_sessions_tie_and_draw_as_the_scan_does() -> None:
    """Requests that never continue a session leave heads on most workers: groups that
    differ only in live sessions, which cost nothing at a continuation rate of 0. The draw
    over their union (less the holders) is the scan's."""
    rng = random.Random(11)
    core, _ = _fleet(rng, 96)
    for i in range(150):  # a head per request, none continued
        hashes = [rng.getrandbits(32) for _ in range(4)]
        core.routed(f"r{i}", rng.randrange(96), hashes, 0.0, 0.0, None, 128)
        core.finished(f"r{i}")
    assert core.follows_sessions and core.continue_rate == 0.0
    assert len(core._groups.groups()) >= 3
    for seed in range(40):
        draw = random.Random(seed)
        hashes = [draw.getrandbits(32) for _ in range(6)]
        # Holders matching on the host tier only: with no credit for it they tie with their
        # group (the draw leaves them out of the group and takes them in one by one); with
        # Dynamo's credit they win.
        held = draw.sample(range(96), draw.choice([0, 1, 5, 30]))
        matches = {w: (draw.choice([1, 6]), 0) for w in held}
        for rate, credit in ((0.0, 0.0), (0.0, 0.75), (1.0, 0.0)):
            config = SchedulerConfig(host_credit=credit)
            _agree(core, draw, hashes, matches, 0.0, config, None, rate)


def test_the_groups_follow_the_books() -> None:
    rng = random.Random(3)
    core, _ = _fleet(rng, 10)
    for i in range(200):
        w = rng.randrange(10)
        hashes = [rng.getrandbits(32) for _ in range(rng.randint(1, 5))]
        core.routed(f"r{i}", w, hashes, float(rng.randint(0, len(hashes))), 0.0)
        if rng.random() < 0.5:
            core.first_token(f"r{rng.randrange(i + 1)}")
        if rng.random() < 0.3:
            core.finished(f"r{rng.randrange(i + 1)}")
    for w in range(10):
        assert core._groups.key(w) == core._key(w)
    core.worker_left(4)
    assert 4 not in core._groups and len(core._groups) == 9
    assert core._groups.ids == [0, 1, 2, 3, 5, 6, 7, 8, 9]


def test_an_empty_fleet_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        choose_fast(1, [], LoadGroups(), SchedulerConfig(), random.Random(0))


def test_a_fleet_with_a_worker_left_out_is_priced_in_full() -> None:
    core, _ = _fleet(random.Random(0), 4)
    routed = core.decide([1, 2, 3], {}, 0.0, random.Random(0), workers=[0, 2])
    assert routed.decision.worker in (0, 2)
    assert {c.worker for c in routed.decision.costs} == {0, 2}


def test_a_lazy_explanation_lists_every_worker_cheapest_first() -> None:
    core, _ = _fleet(random.Random(0), 5)
    core.routed("busy", 3, list(range(100, 160)), 10.0, 0.0)
    routed = core.decide([7, 8], {3: (2, 2)}, 0.0, random.Random(0))
    costs = routed.decision.costs
    assert sorted(c.worker for c in costs) == list(range(5))
    assert [c.cost for c in costs] == sorted(c.cost for c in costs)
    assert routed.decision.chosen == costs[0] or routed.decision.chosen.cost == costs[0].cost
    assert dataclasses.asdict(routed.decision.chosen)["worker"] == routed.decision.worker
