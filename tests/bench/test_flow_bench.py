"""The flow-control benchmark: its fairness arithmetic, and the simulation with a policy that
holds and sheds requests (every request is served or shed, none lost; an unsaturated fleet
holds nothing and routes as flow control off does)."""

from __future__ import annotations

import pytest

from bench.flow import fair_shares, jain, summarize, tag
from bench.policies.flow_policy import FlowPolicy
from bench.policies.kvroute_policy import KvroutePolicy
from bench.sim import SimConfig, simulate
from bench.workloads import GeneratorConfig, WorkloadRequest, generate, scale_rate
from router.settings import RouterSettings

CONFIG = SimConfig(workers=2, capacity_tokens=40_000, block_size=32)


def workload(rate: float) -> list[WorkloadRequest]:
    return generate("multi_turn", GeneratorConfig(
        requests=120, rate=rate, system_prompts=2, system_tokens=(512, 1024),
        user_tokens=(64, 256), output_tokens=(4, 24), turn_gap_s=0.5), seed=1)


def test_fair_shares_fill_the_small_demands_first() -> None:
    assert fair_shares({"a": 100.0, "b": 10.0}, 50.0) == {"a": 40.0, "b": 10.0}
    assert fair_shares({"a": 100.0, "b": 100.0}, 50.0) == {"a": 25.0, "b": 25.0}
    assert fair_shares({"a": 5.0, "b": 5.0}, 10.0) == {"a": 5.0, "b": 5.0}


def test_jain_is_one_when_equal_and_one_over_n_at_worst() -> None:
    assert jain([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


def test_an_unsaturated_fleet_holds_nothing_and_routes_as_without_flow_control() -> None:
    reqs = scale_rate(workload(1.0), 0.25)
    tags = tag(reqs, 1, 0.2)
    off = simulate(reqs, KvroutePolicy(RouterSettings(flow_control=False)), CONFIG, seed=5)
    flow = FlowPolicy(RouterSettings(), tags)
    on = simulate(reqs, flow, CONFIG, seed=5)
    assert not flow.waits and not flow.shed
    assert [(r.worker, r.first_token_s) for r in on.records] == [
        (r.worker, r.first_token_s) for r in off.records]


def test_overload_is_held_or_shed_and_nothing_is_lost() -> None:
    reqs = scale_rate(workload(4.0), 100.0)  # 120 requests in a fraction of a second
    tags = tag(reqs, 1, 0.3)
    settings = RouterSettings(flow_ttft_bound=0.01, flow_max_queue=10,
                              flow_deadlines="1=0.5")
    flow = FlowPolicy(settings, tags)
    result = simulate(reqs, flow, CONFIG, seed=5)
    shed = [r for r in result.records if r.shed]
    served = [r for r in result.records if not r.shed]
    assert flow.waits and shed, "the overload was neither held nor shed"
    assert len(shed) == sum(flow.shed.values())
    assert all(r.finish_s >= 0 and r.tokens_out == r.output_length for r in served)
    row = summarize(result, tags, slo_s=1.0, window_s=10.0)
    assert 0 < row["shed"] < 1 and 0 < row["jain"] <= 1
