"""The benchmark targets on one run's rows: who the peers are, each target's edge, the tally."""

from __future__ import annotations

from typing import Any

from bench.targets import describe, summary_line, tally, verdict


def row(policy: str, p50: float = 0.02, p99: float = 0.1, hit: float = 0.97,
        imbalance: float = 1.1) -> dict[str, Any]:
    return {"policy": policy, "ttft_p50_s": p50, "ttft_p99_s": p99, "hit_vs_pooled": hit,
            "load_imbalance": imbalance}


def test_every_target_met() -> None:
    v = verdict([row("round_robin", 0.03, 0.2), row("kvroute"), row("dynamo", 0.025, 0.1)])
    assert v is not None and v["met"]
    assert v["p50"] == {"met": True, "value": 0.02, "bound": 0.025, "peer": "dynamo"}
    assert v["p99"]["met"] and v["p99"]["peer"] == "dynamo"  # a tie is met
    assert describe(v) == "targets: kvroute meets every target"


def test_a_slower_median_names_the_peer_and_the_margin() -> None:
    v = verdict([row("kvroute", p50=0.0206), row("sglang_cache_aware", p50=0.02, p99=0.3)])
    assert v is not None and not v["met"]
    assert v["p50"]["peer"] == "sglang_cache_aware" and not v["p50"]["met"]
    assert v["p99"]["met"]
    assert describe(v) == ("targets: kvroute misses TTFT p50 0.0206 s, +3.0% against "
                           "sglang_cache_aware's 0.0200")


def test_hit_and_imbalance_edges() -> None:
    peer = row("dynamo", 1.0, 1.0)
    assert verdict([row("kvroute", hit=0.95), peer])["hit"]["met"]  # type: ignore[index]
    low = verdict([row("kvroute", hit=0.949), peer])
    assert low is not None and not low["met"] and not low["hit"]["met"]
    assert verdict([row("kvroute", imbalance=1.3), peer])["met"]  # type: ignore[index]
    high = verdict([row("kvroute", imbalance=1.31), peer])
    assert high is not None and not high["met"]
    assert describe(high) == "targets: kvroute misses imbalance 1.31 (> 1.3)"
    both = verdict([row("kvroute", p99=0.5, hit=0.9), peer])
    assert both is not None and describe(both) == (
        "targets: kvroute misses hit 90.0% of pooled (< 95%)")


def test_kvroute_variants_are_not_peers() -> None:
    rows = [row("kvroute", p50=0.03), row("kvroute[sessions=off]", p50=0.01), row("dynamo", 0.04)]
    v = verdict(rows)
    assert v is not None and v["met"] and v["p50"]["peer"] == "dynamo"
    assert verdict([row("kvroute"), row("kvroute[learn_rates=off]")]) is None  # no peer ran
    assert verdict([row("dynamo"), row("round_robin")]) is None  # kvroute did not run


def test_tally_counts_runs_with_a_verdict() -> None:
    met = verdict([row("kvroute"), row("dynamo", 0.03, 0.2)])
    slow = verdict([row("kvroute", p50=0.05), row("dynamo", 0.03, 0.2)])
    counts = tally([met, slow, None])
    assert counts == {"runs": 2, "met": 1, "p50": 1, "p99": 2, "hit": 2, "imbalance": 2}
    assert summary_line(counts) == (
        "targets over 2 runs: kvroute meets every target in 1; lowest p50 in 1, lowest p99 in "
        "2, hit >= 95% of pooled in 2, imbalance <= 1.3 in 2")
