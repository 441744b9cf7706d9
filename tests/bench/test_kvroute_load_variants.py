"""The load variants of ``kvroute``: each prices load as its docstring says, and runs."""

from __future__ import annotations

import pytest

from bench.policies import KvroutePolicy
from bench.policies.base import RouteRequest
from bench.policies.kvroute_load_variants import LOAD_VARIANTS
from bench.policies.kvroute_pressure import KvrouteAuto
from bench.sim import SimConfig, simulate
from bench.workloads import GeneratorConfig, generate
from tests.support.policies import BS, FakeCluster


def started(policy: KvroutePolicy) -> KvroutePolicy:
    policy.start(FakeCluster())
    return policy


def test_waiting_requests_count_as_decode_only_in_the_waiting_variants() -> None:
    request = RouteRequest("a", tuple(range(10, 170)), (), BS)  # 40 blocks
    hashes = request.hashes
    for name, share in (("kvroute", 0.0), ("kvroute_waiting", 1.0),
                        ("kvroute_waiting_half", 0.5)):
        policy = started(KvrouteAuto() if name == "kvroute" else LOAD_VARIANTS[name]())
        worker = policy.route(RouteRequest("a", request.token_ids, (), BS), 0.0)
        decode = {c.worker: c.decode_blocks for c in policy.candidates(hashes, 0.0)}
        assert decode[worker] == pytest.approx(40 * share), name
        policy.first_token("a", 0.1)  # from here every variant counts it, once
        decode = {c.worker: c.decode_blocks for c in policy.candidates(hashes, 0.1)}
        assert decode[worker] == pytest.approx(40), name


def test_the_externality_variant_prices_a_workers_recent_arrivals() -> None:
    policy = started(LOAD_VARIANTS["kvroute_ext15"]())
    request = RouteRequest("a", tuple(range(10, 170)), (), BS)  # 40 blocks
    first = policy.route(request, 0.0)
    policy.finished("a", 0.5)  # no decode load left: only the arrival history differs
    plain = {c.worker: c.decode_blocks
             for c in KvroutePolicy.candidates(policy, request.hashes, 1.0)}
    extra = {c.worker: c.decode_blocks - plain[c.worker]
             for c in policy.candidates(request.hashes, 1.0)}
    # one arrival in the 10 s window: 15 s x 40 blocks x 0.1 requests/s on that worker only
    assert extra[first] == pytest.approx(60.0)
    assert all(v == 0.0 for w, v in extra.items() if w != first)
    assert policy.candidates(request.hashes, 10.5)[first].decode_blocks == plain[first]


def test_the_lanes_variant_divides_each_workers_decode_load_by_its_share() -> None:
    policy = started(LOAD_VARIANTS["kvroute_lanes70"]())
    n = FakeCluster().num_workers
    light = n * 5 // 8
    assert 0 < light < n
    shares = [0.7] * light + [(n - 0.7 * light) / (n - light)] * (n - light)
    assert sum(shares) == pytest.approx(n)  # the mean load is unchanged
    request = RouteRequest("a", tuple(range(10, 170)), (), BS)  # 40 blocks
    for worker in (0, n - 1):  # one light lane, one heavy
        policy._load.routed(f"r{worker}", worker, 40, 40)
        policy._load.first_token(f"r{worker}")
    decode = {c.worker: c.decode_blocks for c in policy.candidates(request.hashes, 0.0)}
    assert decode[0] == pytest.approx(40 / 0.7)
    assert decode[n - 1] == pytest.approx(40 / shares[-1])
    assert all(decode[w] == 0.0 for w in range(1, n - 1))
    # equal loads: the heavy lane is the cheaper place for more decode
    assert policy.route(request, 0.0) == n - 1


def test_weights_and_cap_of_the_plain_variants() -> None:
    assert [LOAD_VARIANTS[f"kvroute_ow{n}"]().config.overlap_weight for n in (8, 16, 64)] == [
        8.0, 16.0, 64.0]
    assert LOAD_VARIANTS["kvroute_nocap"]().config.queue_cap_blocks == float("inf")
    assert KvrouteAuto().config.queue_cap_blocks == 3000.0


@pytest.mark.parametrize("name", sorted(LOAD_VARIANTS))
def test_every_load_variant_serves_a_small_workload(name: str) -> None:
    reqs = generate("multi_turn", GeneratorConfig(
        requests=40, rate=8.0, system_prompts=2, system_tokens=(512, 1024),
        user_tokens=(64, 256), output_tokens=(4, 24), turn_gap_s=0.5), seed=2)
    result = simulate(reqs, LOAD_VARIANTS[name](), SimConfig(workers=2, capacity_tokens=8_000),
                      seed=1)
    assert len(result.records) == 40
    assert sum(r.cached_tokens for r in result.records) > 0  # sessions found their prefixes
