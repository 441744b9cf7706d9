"""bench.hit_by_wait: a run's hit split by the TTFT its requests paid for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.hit_by_wait import line, main, split
from bench.live import LiveRecord
from bench.policies import make_policies
from bench.sim import RequestRecord, SimConfig, simulate
from bench.workloads import WorkloadRequest


def _record(rid: str, prompt: int, cached: int, ttft: float) -> RequestRecord:
    return RequestRecord(rid, arrival_s=1.0, worker=0, prompt_tokens=prompt, output_length=2,
                         cached_tokens=cached, first_token_s=1.0 + ttft, finish_s=2.0 + ttft)


def test_the_hit_of_requests_over_the_threshold_is_counted_apart() -> None:
    records = [_record("quick", 1000, 500, 0.2), _record("slow", 3000, 2700, 4.0),
               _record("cold", 4000, 0, 9.0)]
    s = split(records, 2.4)
    assert s.hit == pytest.approx(3200 / 8000)
    assert s.slow == 2
    assert s.slow_hit == pytest.approx(2700 / 8000)
    assert s.hit_without == pytest.approx(500 / 8000)
    # Above every TTFT nothing is slow and nothing is taken off.
    none = split(records, 10.0)
    assert (none.slow, none.slow_hit, none.hit_without) == (0, 0.0, none.hit)


def test_a_request_never_served_is_not_slow() -> None:
    shed = RequestRecord("shed", arrival_s=1.0, worker=0, prompt_tokens=1000, output_length=2,
                         shed=True)
    s = split([shed, _record("slow", 1000, 1000, 5.0)], 1.0)
    assert (s.slow, s.slow_hit, s.hit_without) == (1, 0.5, 0.0)


def test_a_live_run_splits_as_its_client_saw_it() -> None:
    # A live record's TTFT is the client's; one that failed has none (-1) and is not slow.
    records = [LiveRecord("quick", 1000, ttft_s=0.3, cached_tokens=800),
               LiveRecord("slow", 1000, ttft_s=3.0, cached_tokens=900),
               LiveRecord("failed", 1000, error="refused")]
    s = split(records, 2.4)
    assert (s.slow, s.slow_hit, s.hit_without) == (1, 0.3, pytest.approx(800 / 3000))
    row = line("live", s)
    assert row.split() == ["live", "56.7%", "2.4s", "1", "30.00", "pt", "26.7%"]


def _request(rid: str, at: float, first: int, tokens: int) -> WorkloadRequest:
    return WorkloadRequest(rid, at, (tuple(range(first, first + tokens)),), tokens, 2)


def test_a_hit_waited_for_behind_a_cold_prefill_is_the_slow_share() -> None:
    # One worker: a 20k-token prompt, then a cold 150k-token one, then the first prompt
    # again, which finds its prefix cached and waits behind the cold prefill for it.
    requests = [_request("warm", 0.0, 1, 20_000), _request("cold", 3.0, 500_000, 150_000),
                _request("again", 3.1, 1, 20_000)]
    (policy,) = make_policies("kvroute")
    result = simulate(requests, policy, SimConfig(workers=1, capacity_tokens=400_000))
    again = next(r for r in result.records if r.request_id == "again")
    assert again.cached_tokens > 0 and again.ttft_s > 1.0
    s = split(result.records, 1.0)
    assert s.slow == 2  # the cold prompt and the one behind it
    assert s.slow_hit == pytest.approx(again.cached_tokens / 190_000)
    assert s.hit_without == 0.0  # the first prompt was cold too


def test_the_command_prints_a_row_per_policy_and_threshold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 700 + 10 * i, "output_length": 4,
             "hash_ids": [i % 3, 100 + i]} for i in range(12)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = main(["--trace", str(trace), "--workers", "2", "--capacity-tokens", "20000",
                   "--policies", "kvroute,round_robin", "--over", "0.5,3", "--no-progress"])
    assert status == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines[2:]]
    assert [(row[0], row[2]) for row in table] == [
        ("kvroute", "0.5s"), ("kvroute", "3.0s"), ("round_robin", "0.5s"),
        ("round_robin", "3.0s")]


@pytest.mark.parametrize("over", ["x", "-1", ","])
def test_bad_thresholds_are_refused(over: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--over", over])
    assert stop.value.code == 2
    assert "--over" in capsys.readouterr().err
