"""``kvroute_pressure``: fed the index's events by the simulation, its queue weight follows the
eviction pressure; with no eviction it is ``kvroute`` with queue weight 0.25."""

from __future__ import annotations

import dataclasses

from bench.policies import KvroutePolicy, KvroutePressure
from bench.sim import SimConfig, simulate
from bench.workloads import GeneratorConfig, WorkloadRequest, generate
from router.pressure import PressureRule
from router.scheduler import SchedulerConfig
from router.settings import RouterSettings

#: The router's scheduler settings without sessions: what the pressure tests were written on.
NO_SESSIONS = dataclasses.replace(RouterSettings().scheduler_config(), session_weight=0.0)


def workload() -> list[WorkloadRequest]:
    return generate("multi_turn", GeneratorConfig(
        requests=60, rate=6.0, system_prompts=3, system_tokens=(512, 1024),
        user_tokens=(64, 256), output_tokens=(4, 24), turn_gap_s=0.5), seed=1)


def fingerprint(result) -> list[tuple]:
    return [(r.request_id, r.worker, r.cached_tokens, r.first_token_s) for r in result.records]


def test_a_small_cache_under_churn_raises_the_pressure_and_lowers_the_weight() -> None:
    policy = KvroutePressure(NO_SESSIONS)  # sessions stick, and churn this cache less
    simulate(workload(), policy, SimConfig(workers=2, capacity_tokens=4_000), seed=3)
    samples = policy.pressure_samples
    assert len(samples) == 60 and samples[0] == 0.0
    assert max(samples) > 0.7  # a 125-block cache turns over fast
    assert policy.config.queue_cap_blocks == 3000.0


def test_without_eviction_it_decides_as_kvroute_at_the_low_pressure_weight() -> None:
    reqs = workload()
    big = SimConfig(workers=2, capacity_tokens=400_000)
    policy = KvroutePressure()
    ours = simulate(reqs, policy, big, seed=3)
    assert max(policy.pressure_samples) == 0.0
    ref = simulate(reqs, KvroutePolicy(dataclasses.replace(
        RouterSettings().scheduler_config(), queue_weight=0.25, queue_cap_blocks=3000.0)),
        big, seed=3)
    assert fingerprint(ours) == fingerprint(ref)
    # ... and the rule's weights do move the decisions once they differ (without sessions:
    # with them, this light load's continuations all stay home whatever the queue weight).
    base = simulate(reqs, KvroutePressure(NO_SESSIONS), big, seed=3)
    other = simulate(reqs, KvroutePressure(NO_SESSIONS, rule=PressureRule(low_pressure_weight=4.0)),
                     big, seed=3)
    assert fingerprint(other) != fingerprint(base)


def test_variants_run_by_name_but_not_in_all() -> None:
    from bench.policies import VARIANTS, make_policies

    names = [p.name for p in make_policies(",".join(VARIANTS))]
    assert names == list(VARIANTS)
    assert not set(VARIANTS) & {p.name for p in make_policies("all")}


def test_the_admission_variant_without_known_limits_is_rule_k_exactly() -> None:
    from bench.policies.kvroute_pressure import KvroutePressureAdmit

    reqs = workload()
    config = SimConfig(workers=2, capacity_tokens=4_000)
    k = simulate(reqs, KvroutePressure(dataclasses.replace(
        RouterSettings().scheduler_config(), admission_weight=0.0)), config, seed=3)
    blind = simulate(reqs, KvroutePressureAdmit(kv=False, max_running=0), config, seed=3)
    assert fingerprint(blind) == fingerprint(k)


def test_the_slot_term_moves_requests_off_a_worker_whose_slots_are_full() -> None:
    from bench.policies.kvroute_pressure import KvroutePressureAdmit

    reqs = workload()
    config = SimConfig(workers=2, capacity_tokens=400_000, max_num_seqs=2)
    k = simulate(reqs, KvroutePressure(SchedulerConfig()), config, seed=3)  # no admission term
    policy = KvroutePressureAdmit(kv=False, max_running=2)
    seq = simulate(reqs, policy, config, seed=3)
    assert fingerprint(seq) != fingerprint(k)

    def queued(result) -> int:  # requests routed behind two in flight on their worker
        events = sorted([(r.arrival_s, 1, r.worker) for r in result.records]
                        + [(r.finish_s, 0, r.worker) for r in result.records])
        busy, behind = [0, 0], 0
        for _, arriving, w in events:
            if arriving:
                behind += busy[w] >= 2
            busy[w] += 1 if arriving else -1
        return behind

    assert queued(seq) < queued(k)


def test_the_admission_variants_read_capacity_from_the_peak_and_held_kv_from_the_books() -> None:
    from bench.policies.kvroute_pressure import KvroutePressureAdmit

    policy = KvroutePressureAdmit()
    simulate(workload()[:20], policy, SimConfig(workers=2, capacity_tokens=4_000), seed=3)
    cands = policy.candidates([1, 2, 3], now=1e6)
    assert [c.kv_capacity_blocks for c in cands] == [policy._pressure.peak(w) for w in (0, 1)]
    assert all(c.kv_capacity_blocks > 0 and c.max_running == 256 for c in cands)
    assert all(c.kv_held_blocks == 0.0 for c in cands)  # every request has finished


def test_distinct_held_kv_counts_a_shared_prefix_once() -> None:
    from bench.policies.base import RouteRequest
    from bench.policies.kvroute_pressure import KvroutePressureAdmit

    books = KvroutePressureAdmit(capacity="model_info")
    distinct = KvroutePressureAdmit(distinct=True, capacity="model_info")
    config = SimConfig(workers=1, capacity_tokens=4_000)
    prefix = list(range(4, 4 + 64))  # two blocks shared by both prompts
    for policy in (books, distinct):
        simulate([], policy, config)  # attach to a one-worker cluster
        policy.route(RouteRequest("a", prefix + [7] * 32), now=0.0)
        policy.route(RouteRequest("b", prefix + [9] * 32), now=0.0)
    probe = RouteRequest("c", prefix + [11] * 32).hashes
    (b,), (d,) = books.candidates(probe, 0.0), distinct.candidates(probe, 0.0)
    assert b.kv_held_blocks == 6.0 and b.kv_shared_blocks == 0.0  # 3 + 3 blocks booked
    assert d.kv_held_blocks == 4.0 and d.kv_shared_blocks == 2.0  # 2 shared + 1 + 1
    assert b.kv_capacity_blocks == d.kv_capacity_blocks == 125.0
    distinct.finished("a", 1.0)
    (d,) = distinct.candidates(probe, 1.0)
    assert d.kv_held_blocks == 3.0 and d.kv_shared_blocks == 2.0
