"""A short replay run writes the JSON with every key, a table and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

# Where its font cache is missing (a fresh machine) matplotlib lists the fonts with fc-list, a
# child process, when first imported: done here, as the module is collected, rather than
# inside the plotting test below, which must start none.
import matplotlib.font_manager  # noqa: F401
import pytest

from bench.replay import main
from bench.report import METRIC_KEYS


def tiny_trace(path: Path) -> Path:
    rows = [{"timestamp": 100 * i, "input_length": 700 + 10 * i, "output_length": 4,
             "hash_ids": [i % 3, 100 + i]} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_short_run_writes_json_table_and_plots(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    plots = tmp_path / "plots"
    status = main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--workers", "2",
                   "--capacity-tokens", "20000", "--policies", "all", "--json", str(out),
                   "--plot-dir", str(plots), "--no-progress"])
    assert status == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"workload", "settings", "requests", "bounds", "runs"}
    assert set(doc["bounds"]) == {"unlimited", "pooled_lru", "pooled_blocks", "prompt_tokens"}
    (run,) = doc["runs"]
    assert [r["policy"] for r in run["rows"]] == [
        "round_robin", "random", "least_loaded", "sglang_cache_aware", "llmd_precise",
        "dynamo", "kvroute"]
    for row in run["rows"]:
        assert set(METRIC_KEYS) <= set(row)
        assert row["requests"] == 12
    for name in ("ttft_cdf.png", "hit_rate.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kvroute" in capsys.readouterr().out


def test_sensitivity_runs_each_lag(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    status = main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--workers", "2",
                   "--capacity-tokens", "20000", "--policies", "kvroute", "--sensitivity",
                   "--json", str(out), "--no-progress"])
    assert status == 0
    lags = [run["event_lag_ms"] for run in json.loads(out.read_text())["runs"]]
    assert lags == [0.0, 10.0, 100.0, 1000.0]


def test_bad_policy_name_is_status_2(tmp_path: Path) -> None:
    assert main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--policies", "nope",
                 "--no-progress"]) == 2


def test_per_worker_rows_add_up_to_the_run(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    status = main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--workers", "2",
                   "--capacity-tokens", "20000", "--policies", "round_robin,kvroute",
                   "--per-worker", "--json", str(out), "--no-progress"])
    assert status == 0
    for row in json.loads(out.read_text())["runs"][0]["rows"]:
        workers = row["per_worker"]
        assert [w["worker"] for w in workers] == [0, 1]
        assert sum(w["requests"] for w in workers) == row["requests"] == 12
        assert all(w["busy_s"] > 0 and w["decode_context_tokens"] > 0 for w in workers)
        mean = sum(w["ttft_mean_s"] * w["requests"] for w in workers) / row["requests"]
        assert mean == pytest.approx(row["ttft_mean_s"])
    printed = capsys.readouterr().out
    assert "round_robin, per worker" in printed and "decode context" in printed


def test_per_worker_with_live_is_refused(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--per-worker",
                 "--live", "http://127.0.0.1:9", "--no-progress"]) == 2
    assert "--per-worker" in capsys.readouterr().err


def test_measured_timing_is_the_default_and_prices_cached_attention_cheaper(
        tmp_path: Path) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl")  # prompts share their first 512 tokens
    e2e, ttft = {}, {}
    for timing in ("calibrated", "paged", "measured", None):
        out = tmp_path / f"{timing}.json"
        flag = [] if timing is None else ["--timing", timing]
        assert main(["--trace", str(trace), "--workers", "2", "--capacity-tokens", "20000",
                     "--policies", "kvroute", *flag, "--json", str(out), "--no-progress"]) == 0
        doc = json.loads(out.read_text())
        assert doc["settings"]["timing"] == (timing or "measured")
        (row,) = doc["runs"][0]["rows"]
        assert row["hit_rate"] > 0  # cached prefills happened
        e2e[timing], ttft[timing] = row["e2e_mean_s"], row["ttft_mean_s"]
    assert 0 < e2e["paged"] < e2e["calibrated"]  # decode over a context: paged is cheaper
    assert 0 < ttft["measured"] < ttft["paged"]  # prefill over a cached prefix: cheaper still
    assert (e2e[None], ttft[None]) == (e2e["measured"], ttft["measured"])


def test_set_changes_every_kvroute_policys_router_settings() -> None:
    from bench.replay import build_parser
    from bench.replay_setup import build_policies

    names = ["--policies", "kvroute,kvroute[predict_ttl=1],round_robin"]
    default = build_policies(build_parser().parse_args(names))
    assert [getattr(p, "settings", None) and p.settings.predict_ttl for p in default] == [
        10.0, 1.0, None]
    forced = build_policies(build_parser().parse_args([*names, "--set", "predict_ttl=2",
                                                  "--set", "sessions=off"]))
    assert [p.settings.predict_ttl for p in forced[:2]] == [2.0, 2.0]
    assert [p.settings.sessions for p in forced[:2]] == [False, False]
    assert [p.name for p in forced] == ["kvroute", "kvroute[predict_ttl=1]", "round_robin"]


@pytest.mark.parametrize(("value", "fragment"), [
    ("predict_ttl=-1", "ttls must be positive"),
    ("predict_ttl=four", "predict_ttl from flag: 'four'"),
    ("temperature=1", "not NAME=VALUE with NAME a router setting"),
    ("sessions", "not NAME=VALUE")])
def test_bad_router_settings_are_errors(value: str, fragment: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--set", value,
                 "--no-progress"]) == 2
    assert fragment in capsys.readouterr().err


def test_unknown_timing_model_is_a_usage_error(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--timing", "fast"])
    assert exc.value.code == 2
    assert "--timing" in capsys.readouterr().err


@pytest.mark.process
def test_seeds_run_each_seed_with_a_verdict_and_tally(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, serial = tmp_path / "out.json", tmp_path / "serial.json"
    common = ["--generator", "system_prompt", "--requests", "30", "--workers", "2",
              "--policies", "kvroute,kvroute[learn_rates=off],round_robin", "--seeds", "0-1,3",
              "--no-progress"]
    assert main([*common, "--jobs", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert main([*common, "--json", str(serial)]) == 0
    doc, one = json.loads(out.read_text()), json.loads(serial.read_text())
    assert [r["seed"] for r in doc["runs"]] == [0, 1, 3]
    # each seed draws its own workload, so its own bounds
    assert len({r["bounds"]["prompt_tokens"] for r in doc["runs"]}) == 3
    for run, ref in zip(doc["runs"], one["runs"], strict=True):
        assert run["targets"]["policy"] == "kvroute"
        assert run["targets"]["p50"]["peer"] == "round_robin"  # kvroute[...] is ours
        # processes give the same simulation as one process
        for a, b in zip(run["rows"], ref["rows"], strict=True):
            assert a["ttft_p99_s"] == b["ttft_p99_s"] and a["hit_rate"] == b["hit_rate"]
    met = sum(r["targets"]["met"] for r in doc["runs"])
    assert doc["targets"]["runs"] == 3 and doc["targets"]["met"] == met
    assert printed.count("targets: kvroute") == 3
    assert f"targets over 3 runs: kvroute meets every target in {met};" in printed


@pytest.mark.parametrize("value", ["2-1", "a", "0,0", "-1", "1-x"])
def test_bad_seeds_are_usage_errors(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--seeds", value, "--no-progress"])
    assert exc.value.code == 2
    assert "--seeds" in capsys.readouterr().err


def test_seed_and_seeds_together_or_jobs_zero_are_usage_errors(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--seed", "1", "--seeds", "0-2"], ["--jobs", "0"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--no-progress"])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and "--jobs" in err


def test_seeds_with_live_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--seeds", "0-1",
                 "--live", "http://127.0.0.1:9", "--no-progress"]) == 2
    assert "--seeds and --jobs are for simulations" in capsys.readouterr().err


def test_seeds_over_the_trace_load_it_once_and_vary_only_the_randomness(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    assert main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--workers", "2",
                 "--capacity-tokens", "20000", "--policies", "random,kvroute", "--seeds", "0-2",
                 "--json", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().err.count("workload t.jsonl") == 1  # one load, one bounds
    runs = json.loads(out.read_text())["runs"]
    assert [r["seed"] for r in runs] == [0, 1, 2]
    assert len({json.dumps(r["bounds"]) for r in runs}) == 1
    assert len({r["rows"][0]["ttft_mean_s"] for r in runs}) > 1  # random's picks follow the seed


def test_kvroute_bench_runs_the_replay_through_the_entry_point(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvroute.cli import main as kvroute

    out = tmp_path / "out.json"
    assert kvroute(["bench", "replay", "--trace", str(tiny_trace(tmp_path / "t.jsonl")),
                    "--workers", "2", "--policies", "kvroute,round_robin", "--json", str(out),
                    "--no-progress"]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())["runs"][0]["rows"]] == [
        "kvroute", "round_robin"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as listed:
        kvroute(["bench", "--help"])
    assert listed.value.code == 0 and "replay" in capsys.readouterr().out
    with pytest.raises(SystemExit) as replay_help:
        kvroute(["bench", "replay", "--help"])
    assert replay_help.value.code == 0
    assert "usage: kvroute bench replay" in capsys.readouterr().out
    with pytest.raises(SystemExit) as unknown:
        kvroute(["bench", "nope"])
    assert unknown.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_topologies_print_each_load_side_by_side_and_the_spread_over_seeds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "topo.json"
    status = main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--topologies", "2,1p1d",
                   "--rate-scales", "1,2", "--seeds", "1-2", "--no-progress",
                   "--policies", "kvroute,kvroute[pd_local_prefill_tokens=0]",
                   "--json", str(out_json)])
    assert status == 0
    out = capsys.readouterr().out
    assert out.count("topology  policy") == 2 * 2 + 2  # per seed and load, then per load
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 * 2
    # Aggregated workers never prefill remotely; the split ones do, all of it at threshold 0.
    assert {r["remote_prefill_share"] for r in rows if r["topology"] == "2"} == {0.0}
    assert {r["remote_prefill_share"] for r in rows if r["topology"] == "1p1d"
            and r["policy"] == "kvroute[pd_local_prefill_tokens=0]"} == {1.0}
    assert main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--topologies", "1p1d",
                 "--policies", "round_robin", "--no-progress"]) == 2
    assert main(["--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--topologies", "3q",
                 "--no-progress"]) == 2
