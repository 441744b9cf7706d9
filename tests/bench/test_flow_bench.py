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


def test_a_live_run_counts_429s_as_shed_and_reports_engine_seconds() -> None:
    from bench.flow_live import summarize_records
    from bench.live import LiveRecord

    tags = {"a": (0, "chat"), "b": (1, "bulk"), "c": (1, "bulk"), "d": (1, "bulk")}
    records = [LiveRecord("a", 100, ttft_s=2.0), LiveRecord("b", 100, ttft_s=20.0),
               LiveRecord("c", 100, error="HTTP 429"), LiveRecord("d", 100, error="HTTP 503")]
    # Speedup 0.1: 2 wall seconds are 0.2 engine seconds (within the SLO of 1), 20 are 2.
    row = summarize_records(records, tags, slo_s=1.0, window_s=10.0, speedup=0.1)
    assert row["goodput_rps"] == pytest.approx(1.0)  # one good request in 1 engine second
    assert row["shed"] == 0.25 and row["failed"] == 0.25
    assert row["p0_ttft_p50_s"] == pytest.approx(0.2) and row["p1_ttft_p99_s"] == pytest.approx(2)


def test_without_room_kept_the_low_band_fills_to_the_bound() -> None:
    reqs = scale_rate(workload(4.0), 100.0)
    tags = tag(reqs, 1, 0.3)
    settings = RouterSettings(flow_ttft_bound=0.01, flow_max_queue=10, flow_deadlines="1=0.5")
    results = {}
    for keep in (True, False):
        flow = FlowPolicy(settings, tags, keep_room=keep)
        result = simulate(reqs, flow, CONFIG, seed=5)
        assert all(r.finish_s >= 0 for r in result.records if not r.shed)
        results[keep] = [(r.worker, r.shed) for r in result.records]
    assert results[True] != results[False]  # the rule changes which requests go where
