"""Each policy on a tiny two-worker scenario makes the choice its documentation says."""

from __future__ import annotations

import pytest

from bench.policies import (
    Dynamo,
    KvroutePolicy,
    LeastLoaded,
    LlmdPrecise,
    RandomPolicy,
    RoundRobin,
    RouteRequest,
    SglangCacheAware,
    WorkerMetrics,
    make_policies,
)
from indexer.index import GLOBAL_SEED, block_hashes
from openai_request.prompts import PromptTokens
from router.routing.load import ReportedLoad
from router.routing.prompt_path import HashingTerms, request_hashes
from tests.support.policies import BS, FakeCluster


def rr(rid: str, tokens: tuple[int, ...]) -> RouteRequest:
    return RouteRequest(rid, tokens, (), BS)


PROMPT = tuple(range(10, 50))  # 10 blocks


def test_route_request_hashes_equal_the_router_path() -> None:
    expected = request_hashes(PromptTokens(list(PROMPT[:-2])), HashingTerms(BS))
    assert rr("x", PROMPT[:-2]).hashes == expected
    assert expected == block_hashes(PROMPT[:36], BS, seed=GLOBAL_SEED)


def test_round_robin_cycles_and_random_stays_in_range() -> None:
    p = RoundRobin()
    p.start(FakeCluster())
    assert [p.route(rr(str(i), PROMPT), 0.0) for i in range(4)] == [0, 1, 0, 1]
    q = RandomPolicy()
    q.start(FakeCluster())
    assert {q.route(rr(str(i), PROMPT), 0.0) for i in range(20)} == {0, 1}


def test_least_loaded_takes_the_worker_with_fewer_in_flight() -> None:
    p = LeastLoaded()
    p.start(FakeCluster())
    first = p.route(rr("a", PROMPT), 0.0)
    assert p.route(rr("b", PROMPT), 0.0) == 1 - first
    p.finished("a", 1.0)
    assert p.route(rr("c", PROMPT), 1.0) == first


def sglang_with_loads(loads: tuple[int, int]) -> SglangCacheAware:
    p = SglangCacheAware()
    p.start(FakeCluster())
    # Worker 0's tree holds PROMPT (routed there before); set the in-flight loads by hand.
    p._insert(0, rr("seed", PROMPT).hashes)
    p._load = list(loads)
    return p


def test_sglang_follows_a_match_over_30_percent_when_balanced() -> None:
    p = sglang_with_loads((64, 0))  # gap exactly 64: balanced (strict >)
    assert not p.imbalanced()
    assert p.route(rr("a", PROMPT), 0.0) == 0


def test_sglang_routes_to_least_loaded_when_imbalanced_by_both_thresholds() -> None:
    p = sglang_with_loads((65, 0))  # 65 - 0 > 64 and 65 > 1.5 x 0
    assert p.imbalanced()
    assert p.route(rr("a", PROMPT), 0.0) == 1
    # ... and inserts the prompt under worker 1 too.
    assert p._match(rr("b", PROMPT).hashes) == (10, {0, 1})


def test_sglang_gap_over_64_but_ratio_under_1_5_is_balanced() -> None:
    p = sglang_with_loads((200, 135))  # 65 apart, but 200 < 1.5 x 135
    assert not p.imbalanced()
    assert p.route(rr("a", PROMPT), 0.0) == 0


def test_sglang_sends_a_weak_match_to_the_smallest_tree() -> None:
    p = sglang_with_loads((0, 0))
    # Shares 3 of 10 blocks (12 of 40 tokens = 30%, not more): the smallest tree wins.
    other = PROMPT[:12] + tuple(range(500, 528))
    assert p.route(rr("a", other), 0.0) == 1
    # 4 of 10 blocks (40%) follows the match.
    other = PROMPT[:16] + tuple(range(600, 624))
    assert p.route(rr("b", other), 0.0) == 0


def test_llmd_weighs_prefix_queue_and_kv_3_2_2() -> None:
    cluster = FakeCluster([WorkerMetrics(4, 3, 0.5), WorkerMetrics(0, 0, 0.0)])
    p = LlmdPrecise()
    p.start(cluster)
    req = rr("a", PROMPT)
    cluster.index.store_hashes(0, req.hashes)  # worker 0 holds the whole prompt
    # Worker 0: 3 x 1.0 + 2 x 0 (busiest queue) + 2 x 0.5 = 4.0; worker 1: 0 + 2 + 2 = 4.0.
    assert p.scores(req, 0.0) == [4.0, 4.0]
    cluster.metrics = [WorkerMetrics(4, 1, 0.5), WorkerMetrics(0, 0, 0.0)]
    # Metrics are scraped every 50 ms: at 10 ms the old values still stand.
    assert p.scores(req, 0.01) == [4.0, 4.0]
    cluster.metrics = [WorkerMetrics(4, 3, 0.25), WorkerMetrics(0, 0, 0.0)]
    assert p.scores(req, 0.06) == [4.5, 4.0]
    assert p.route(req, 0.06) == 0


def test_llmd_scores_zero_prefix_without_the_first_block() -> None:
    cluster = FakeCluster()
    p = LlmdPrecise()
    p.start(cluster)
    req = rr("a", PROMPT)
    cluster.index.store_hashes(0, req.hashes[1:])  # everything but the first block
    assert p.scores(req, 0.0) == [4.0, 4.0]


def test_dynamo_trades_overlap_against_prefill_and_decode_blocks() -> None:
    cluster = FakeCluster()
    p = Dynamo()
    p.start(cluster)
    req = rr("a", PROMPT)
    cluster.index.store_hashes(0, req.hashes[:6])  # 6 of 10 blocks cached on worker 0
    assert p.route(req, 0.0) == 0  # cost 4 vs 10
    # "a" is prefilling on 0 with 4 pending blocks: for "b" worker 0 costs 4 + 4 = 8 < 10.
    assert p.route(rr("b", PROMPT), 0.0) == 0
    p.first_token("a", 0.1)
    p.first_token("b", 0.1)
    # Both decode on 0 now (10 blocks each): 4 + 20 > 10, so worker 1.
    assert p.route(rr("c", PROMPT), 0.2) == 1


def test_kvroute_predicts_residency_before_events_arrive() -> None:
    cluster = FakeCluster()
    (p,) = make_policies("kvroute[predict_ttl=2]")  # predictions live 2 s
    assert isinstance(p, KvroutePolicy)
    p.start(cluster)
    first = p.route(rr("a", PROMPT), 0.0)
    p.first_token("a", 0.05)
    p.finished("a", 0.1)
    # No event reached the index, yet the sibling follows the predicted prefix ...
    assert p.route(rr("b", PROMPT), 0.2) == first
    p.finished("b", 0.3)
    # ... until the prediction expires (2 s).
    hashes = rr("c", PROMPT).hashes
    assert p.core.candidates([first], hashes, {}, 2.5)[0].matched_blocks == 0


def test_make_policies_knows_all_and_rejects_unknown_names() -> None:
    names = [p.name for p in make_policies("all")]
    assert names == ["round_robin", "random", "least_loaded", "sglang_cache_aware",
                     "llmd_precise", "dynamo", "kvroute"]
    with pytest.raises(ValueError, match="unknown"):
        make_policies("round_robin,nope")
    with pytest.raises(ValueError, match="unknown router settings"):
        make_policies("kvroute[temperature=1]")
    with pytest.raises(ValueError, match="learn_rates"):
        make_policies("kvroute[learn_rates=maybe]")
    (a, b) = make_policies("kvroute[learn_rates=off,sessions=off],dynamo")
    assert a.name == "kvroute[learn_rates=off,sessions=off]" and b.name == "dynamo"


@pytest.mark.parametrize(("queued_blocks", "expected"), [(0.0, 0), (30.0, 1)])
def test_kvroute_trades_a_wait_against_a_recompute_in_seconds(queued_blocks: float,
                                                              expected: int) -> None:
    cluster = FakeCluster()
    # Hand-set rates: a second per token of prefill, nothing else.
    (p,) = make_policies("kvroute[rates=prefill=1]")
    p.start(cluster)
    req = rr("a", PROMPT)
    cluster.index.store_hashes(0, req.hashes)  # worker 0 holds all 10 blocks (40 tokens) ...
    # ... behind another router's queued prefill (in the worker's report): 30 blocks are
    # 120 s there against 40 s to recompute on worker 1; none is 0 s.
    p.core.load_reported(0, ReportedLoad(running=1, pending_prefill_blocks=queued_blocks))
    assert p.route(req, 0.0) == expected


def test_kvroute_decides_with_the_routers_default_settings() -> None:
    from bench.policies import POLICIES
    from router.settings import RouterSettings

    p = POLICIES["kvroute"]()
    assert isinstance(p, KvroutePolicy)
    p.start(FakeCluster())
    assert p.settings == RouterSettings()
    assert p.core.settings.learns and p.core.settings.block_size == BS  # the cluster's


def test_kvroute_learns_a_slow_workers_rates_and_keeps_its_predictions() -> None:
    cluster = FakeCluster()
    (p,) = make_policies("kvroute")
    assert isinstance(p, KvroutePolicy)
    p.start(cluster)
    for i in range(40):  # each first token takes 10x the work the default rates predict
        req = rr(f"r{i}", tuple(range(1000 * i, 1000 * i + 40)))
        worker = p.route(req, 10.0 * i)
        work = p.core._booked[f"r{i}"].work_s  # an idle fleet: its own prefill only
        p.first_token(f"r{i}", 10.0 * i + p.core.rates(worker).first_s + 10 * work)
        p.finished(f"r{i}", 10.0 * i + 1.0)
    assert [round(p.core.rate_factor(w), 3) for w in (0, 1)] == [10.0, 10.0]
    kept = p.predictions()
    assert kept is not None and len(kept) == 40 and all(d > pr for pr, d in kept[:4])


def test_kvroute_prefers_an_idle_holder_over_live_sessions_elsewhere() -> None:
    cluster = FakeCluster()
    (p,) = make_policies("kvroute")
    p.start(cluster)
    home = p.route(rr("turn1", PROMPT), 0.0)
    p.first_token("turn1", 0.1)
    p.finished("turn1", 0.2)
    for i in range(3):  # more conversations homed on the same worker
        other = tuple(range(100 * (i + 1), 100 * (i + 1) + 8))
        p.core.routed(f"s{i}", home, rr(f"s{i}", other).hashes,
                      p.core.decide([], {}, 0.3, cluster.rng, workers=[home]).decision.chosen,
                      0.3, None, 8)
        p.core.finished(f"s{i}")
    turn2 = PROMPT + tuple(range(60, 68))
    assert p.route(rr("turn2", turn2), 1.0) == home  # its prefix is there, both idle
