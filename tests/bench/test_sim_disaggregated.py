"""Disaggregated serving in the simulation: prefill workers, the KV transfer, decode workers
whose steps no longer share a pass with prefill chunks, and selective disaggregation."""

from __future__ import annotations

import pytest

from bench.policies import POLICIES, kvroute_with
from bench.sim import SimConfig, simulate
from bench.topology import parse_topology
from bench.workloads import WorkloadRequest
from workers.engine.timing import TIMING_MODELS

BS = 32
TIMING = TIMING_MODELS["measured"]


def request(rid: str, at: float, prompt: tuple[int, ...], output: int) -> WorkloadRequest:
    return WorkloadRequest(rid, at, (prompt,), len(prompt), output)


def tokens(seed: int, n: int) -> tuple[int, ...]:
    return tuple(4 + (seed * 7919 + i * 31) % 256 for i in range(n))


def config(roles: tuple[str, ...], **changes) -> SimConfig:
    return SimConfig(workers=len(roles), capacity_tokens=200_000, block_size=BS, roles=roles,
                     **changes)


def test_a_remote_prefill_runs_on_the_prefill_worker_and_moves_its_kv() -> None:
    prompt = tokens(1, 1000)  # 31 full blocks before the block of the last token
    reqs = [request("a", 0.0, prompt, 8)]
    res = simulate(reqs, POLICIES["kvroute"](), config(("prefill", "decode")))
    (rec,) = res.records
    assert (rec.prefill_worker, rec.worker) == (0, 1)
    assert rec.tokens_out == 8 and rec.cached_tokens == 0  # what the prefill worker found
    assert (res.transfers, res.transferred_tokens) == (1, 31 * BS)
    # The decode worker's first token comes after the prefill, the transfer and its own
    # pass over the last block.
    transfer_s = 31 * BS * TIMING.kv_bytes_per_token / 25e9
    prefill_s = TIMING.prefill_ms(1000) / 1e3
    assert rec.first_token_s > prefill_s + transfer_s
    assert len(res.token_gaps_s) == 7


def test_decode_steps_beside_a_long_prefill_wait_on_it_only_when_aggregated() -> None:
    # "a" decodes a long answer; "b", a 8k-token prompt, arrives in the middle of it. On one
    # aggregated worker a pass of a's decode carries b's prefill chunk; with b prefilled on a
    # prefill worker, a's steps stay decode-only.
    reqs = [request("a", 0.0, tokens(1, 64), 200), request("b", 0.2, tokens(2, 8192), 4)]
    alone = simulate(reqs, POLICIES["kvroute"](), config(("both",)))
    split = simulate(reqs, kvroute_with("kvroute[pd_local_prefill_tokens=0]"),
                     config(("prefill", "decode")))
    chunk_s = TIMING.iteration_ms([(8191, 0)], [200]) / 1e3
    assert max(alone.token_gaps_s) >= 0.9 * chunk_s
    assert max(split.token_gaps_s) < TIMING.decode_ms([300, 8192]) / 1e3 * 1.5
    assert max(split.token_gaps_s) < max(alone.token_gaps_s) / 3


def test_a_follow_up_the_decode_worker_holds_is_prefilled_there_under_the_threshold() -> None:
    first = tokens(3, 2048)
    follow = first + tokens(4, 100)  # 100 new tokens past what the decode worker holds
    reqs = [request("a", 0.0, first, 4), request("b", 5.0, follow, 4)]
    for threshold, remote in ((256, [True, False]), (0, [True, True])):
        policy = kvroute_with(f"kvroute[pd_local_prefill_tokens={threshold}]")
        res = simulate(reqs, policy, config(("prefill", "decode")))
        assert [r.prefill_worker == 0 for r in res.records] == remote
        assert [r.worker for r in res.records] == [1, 1]
        assert res.transfers == sum(remote)


def test_a_policy_that_knows_no_roles_is_refused_a_disaggregated_cluster() -> None:
    with pytest.raises(ValueError, match="does not route for prefill and decode roles"):
        simulate([request("a", 0.0, tokens(1, 64), 2)], POLICIES["round_robin"](),
                 config(("prefill", "decode")))


def test_roles_are_checked() -> None:
    with pytest.raises(ValueError, match="names 1 workers, not 2"):
        SimConfig(workers=2, roles=("both",))
    with pytest.raises(ValueError, match="roles must each be one of"):
        SimConfig(workers=1, roles=("encode",))


def test_topology_specs() -> None:
    assert parse_topology("4") == ("both",) * 4
    assert parse_topology("1p3d") == ("prefill", "decode", "decode", "decode")
    for bad in ("2p0d", "p3d", "four", "0"):
        with pytest.raises(ValueError):
            parse_topology(bad)
