"""bench.gpu.fleet_runs: its run and config specs, the workloads they name, and the flags a
config passes to every worker."""

from __future__ import annotations

import pytest

from bench.gpu.fleet_runs import RunSpec, main, parse_configs, parse_runs, schedule, workload
from bench.gpu_routing import Fleet, build_parser, labelled, router_args


def test_runs_parse_workload_seed_count_and_load() -> None:
    assert parse_runs("trace:0:70@0.3, long_context:2:80@1.5") == [
        RunSpec("trace", 0, 70, 0.3), RunSpec("long_context", 2, 80, 1.5)]


@pytest.mark.parametrize("bad", ["", "trace:0:70", "trace:0@0.3", "trace:0:0@0.3",
                                 "trace:0:5@0", "trace:x:5@1"])
def test_bad_runs_are_refused_with_the_entry(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_runs(bad)


def test_configs_split_their_flags_and_refuse_repeats() -> None:
    assert parse_configs("fcfs=; short=--short-prefill 2048 --short-pass-tokens 2048") == [
        ("fcfs", []), ("short", ["--short-prefill", "2048", "--short-pass-tokens", "2048"])]
    for bad in ("a=;a=--x 1", "noflags", "=--x 1"):
        with pytest.raises(ValueError):
            parse_configs(bad)


def test_the_schedule_rotates_which_router_meets_each_run_first() -> None:
    runs = parse_runs("trace:0:70@0.6,trace:0:70@0.3")
    routers = parse_configs("kv=;nofetch=--kv-fetch off;rr=--policy round_robin")
    order = schedule(runs, routers, repeats=3)
    assert len(order) == 2 * 3 * 3
    firsts = [order[i][2][0] for i in range(0, len(order), 3)]
    assert firsts == ["kv", "nofetch", "nofetch", "rr", "rr", "kv"]
    for rep in range(3):
        for spec in runs:
            assert sorted(r[0] for k, s, r in order if k == rep and s == spec) == [
                "kv", "nofetch", "rr"]


def test_workloads_are_the_trace_window_or_the_generator_within_the_model_length() -> None:
    trace = workload(RunSpec("trace", 0, 20, 1.0), 65536)
    assert 0 < len(trace) <= 20 and trace[0].arrival_s == 0.0
    conversations = workload(RunSpec("long_context", 2, 12, 1.0), 16384)
    assert conversations and all(r.input_length + r.output_length <= 16384
                                 for r in conversations)


def test_a_config_passes_the_prefill_order_to_every_worker() -> None:
    args = build_parser().parse_args(["--workers", "2", "--device", "cpu", "--short-prefill",
                                      "2048", "--short-pass-tokens", "4096"])
    argv = Fleet(args, "kv", None).cluster.worker_args
    assert argv[argv.index("--short-prefill") + 1] == "2048"
    assert argv[argv.index("--short-pass-tokens") + 1] == "4096"
    plain = Fleet(build_parser().parse_args(["--device", "cpu"]), "kv", None).cluster.worker_args
    assert "--short-prefill" not in plain


def test_bad_specs_exit_2_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--runs", "trace:0:5"]) == 2
    assert "WORKLOAD:SEED:COUNT@LOAD" in capsys.readouterr().err


def test_the_secret_goes_to_the_router_and_every_worker_and_kv_fetch_to_the_router() -> None:
    args = build_parser().parse_args(["--workers", "2", "--device", "cpu",
                                      "--kv-transfer-secret-file", "/tmp/s", "--kv-fetch", "off"])
    cluster = Fleet(args, "kv", None).cluster
    for argv in (cluster.worker_args, cluster.router_args):
        assert argv[argv.index("--kv-transfer-secret-file") + 1] == "/tmp/s"
    assert cluster.router_args[cluster.router_args.index("--kv-fetch") + 1] == "off"
    assert "--kv-fetch" not in cluster.worker_args
    plain = router_args(build_parser().parse_args([]), "round_robin")
    assert plain == ["--policy", "round_robin", "--seed", "0"]


def test_fetch_counters_are_read_by_their_label() -> None:
    text = "\n".join([
        "# TYPE kvroute_fetch_results_total counter",
        'kvroute_fetch_results_total{outcome="fetched"} 7.0',
        'kvroute_fetch_results_total{outcome="failed"} 1.0',
        "kvroute_fetch_bytes_total 3.5e+08",
        'kvroute_fetch_results_total_created{outcome="fetched"} 1.7e+09',
    ])
    assert labelled(text, "kvroute_fetch_results_total") == {"fetched": 7.0, "failed": 1.0}
    assert labelled(text, "kvroute_fetch_bytes_total") == {"": 3.5e8}
    assert labelled(text, "kvroute_worker_kv_fetch_transfers_total") == {}


def test_bad_router_settings_exit_2_before_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--runs", "trace:0:5@1", "--routers", "kv=;kv=--kv-fetch off"]) == 2
    assert "named twice" in capsys.readouterr().err
