"""bench.topology_live: the fleet each topology starts, its figures in engine seconds, and a
real fleet started, replayed against and stopped."""

from __future__ import annotations

import argparse
import json
import math
import urllib.request
from pathlib import Path

import pytest

from bench.replay import build_parser, main
from bench.topology import parse_topology
from bench.topology_live import _fleet, _variants, engine_row, plan_fleet, remote_share


def _args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["--live-topologies", "1p2d", *extra])


def test_a_split_topology_gives_each_worker_its_role_and_the_router_the_threshold() -> None:
    args = _args("--speedup", "0.5", "--capacity-tokens", "64000", "--block-size", "16")
    plan = plan_fleet(parse_topology("1p2d"), args, 0, list(range(9000, 9010)))
    assert plan.router_url == "http://127.0.0.1:9000"
    assert plan.worker_urls == ("http://127.0.0.1:9001", "http://127.0.0.1:9004",
                                "http://127.0.0.1:9007")
    router = list(plan.router)
    workers = [router[i + 1] for i, a in enumerate(router) if a == "--worker"]
    assert workers == ["http://127.0.0.1:9001,role=prefill", "http://127.0.0.1:9004,role=decode",
                       "http://127.0.0.1:9007,role=decode"]
    assert router[router.index("--pd-local-prefill-tokens") + 1] == "0"
    # the router is told the link in wall time: the workers' transfers last 1/speedup longer
    assert float(router[router.index("--pd-transfer-bandwidth") + 1]) == 25e9 * 0.5
    first = list(plan.workers[0])
    assert first[first.index("--events-port") + 1] == "9002"
    assert first[first.index("--num-blocks") + 1] == str(64000 // 16)
    assert first[first.index("--kv-bytes-per-token") + 1] == \
        router[router.index("--pd-kv-bytes-per-token") + 1] == "32768"
    assert first[first.index("--speedup") + 1] == "0.5"


def test_aggregated_workers_get_no_role_and_the_router_its_default_threshold() -> None:
    plan = plan_fleet(parse_topology("2"), _args(), None, list(range(9000, 9007)))
    router = list(plan.router)
    assert [router[i + 1] for i, a in enumerate(router) if a == "--worker"] == \
        ["http://127.0.0.1:9001", "http://127.0.0.1:9004"]
    assert "--pd-local-prefill-tokens" not in router
    with pytest.raises(ValueError, match="need 7 ports"):
        plan_fleet(parse_topology("2"), _args(), None, [9000])


def test_a_split_topology_runs_once_per_threshold_an_aggregated_one_once() -> None:
    assert _variants(["4", "1p3d"], [0, 256]) == [("4", None), ("1p3d", 0), ("1p3d", 256)]


def test_wall_figures_become_engine_seconds() -> None:
    row = engine_row({"ttft_p50_s": 2.0, "itl_p99_s": 0.1, "output_tok_s": 300.0,
                      "wall_s": 40.0, "errors": 0}, 0.1)
    assert row["ttft_p50_s"] == pytest.approx(0.2) and row["itl_p99_s"] == pytest.approx(0.01)
    assert row["output_tok_s"] == pytest.approx(3000.0) and row["wall_s"] == 40.0


def test_the_remote_share_is_read_from_the_routers_metrics() -> None:
    text = ('# HELP kvroute_pd_prefills ...\nkvroute_pd_prefills_total{outcome="remote"} 30.0\n'
            'kvroute_pd_prefills_total{outcome="local"} 10.0\n')
    assert remote_share(text, 40) == 0.75
    assert math.isnan(remote_share("", 40))


@pytest.mark.parametrize("flags", [["--live-topologies", "3x"],
                                   ["--live-topologies", "1p1d", "--live-local-prefill", "-1"],
                                   ["--live-topologies", "1p1d", "--rate-scales", "0"]])
def test_a_bad_flag_is_refused_before_any_process_starts(flags: list[str],
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    assert main(flags) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.process
def test_a_fleet_that_fails_to_start_is_stopped_whole() -> None:
    from kvroute.up import free_port

    ports = [free_port() for _ in range(4)]
    plan = plan_fleet(parse_topology("1"), _args(), None, ports)
    broken = plan.__class__(plan.workers, plan.worker_urls,
                            (*plan.router, "--policy", "no-such-policy"), plan.router_url)
    with pytest.raises(RuntimeError, match="exited"), _fleet(broken, 0, 60):
        pass
    with pytest.raises(OSError):  # the worker that did start is gone
        urllib.request.urlopen(f"{plan.worker_urls[0]}/health", timeout=2)


@pytest.mark.process
def test_one_command_replays_each_topology_on_a_fleet_of_its_own(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]
                                                                 ) -> None:
    out = tmp_path / "rows.json"
    status = main(["--live-topologies", "1,1p1d", "--live-local-prefill", "0",
                   "--generator", "system_prompt", "--requests", "6", "--rate-scales", "1",
                   "--speedup", "20", "--capacity-tokens", "32000", "--fleet-nice", "0",
                   "--no-progress", "--json", str(out)])
    assert status == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["topology"], r["policy"]) for r in rows] == [("1", "kvroute"), ("1p1d", "local<=0")]
    assert all(r["errors"] == 0 and r["itl_p50_s"] > 0 and r["output_tok_s"] > 0 for r in rows)
    assert rows[1]["remote_prefill_share"] == 1.0 and rows[0]["remote_prefill_share"] == 0.0
    assert "ITL p50 ms" in capsys.readouterr().out
