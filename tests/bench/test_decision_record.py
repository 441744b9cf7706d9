"""bench.decision_record: each decision beside the simulated cluster's truth."""

from __future__ import annotations

import pytest

from bench.decision_record import Candidate, Decision, record, report, summarize
from bench.sim import SimConfig
from bench.workloads import WorkloadRequest


def _request(rid: str, at: float, first: int, tokens: int) -> WorkloadRequest:
    return WorkloadRequest(rid, at, (tuple(range(first, first + tokens)),), tokens, 2)


def test_a_prefill_under_way_is_booked_whole_while_its_engine_works_through_it() -> None:
    # One worker: a 60k-token cold prompt (about 0.9 s of prefill), and 0.2 s later a short
    # one queued behind it. At the second decision the books hold all of the first prompt's
    # blocks; the engine has computed part of them.
    config = SimConfig(workers=1, capacity_tokens=200_000)
    decisions = record([_request("long", 0.0, 1, 60_000), _request("short", 0.2, 900_000, 640)],
                       config)
    long, short = decisions
    assert long.candidates[0].booked_blocks == 0  # nothing queued before it
    queued = short.candidates[0]
    assert queued.booked_blocks == 60_000 // 32
    assert 0 < queued.left_blocks < queued.booked_blocks
    assert queued.wait_s > 0 and short.busy
    # It waited for what was left of the first prompt, less than what was booked for it.
    delivered = short.ttft_s - queued.alone_s
    assert 0 < delivered < queued.wait_s
    s = summarize(decisions, config.block_size)
    assert (s.decisions, s.queued_candidates) == (2, 1)
    assert s.booked_blocks > s.left_blocks
    assert "1 decisions" in report(s)


def _candidate(matched: int, wait: float, booked: float, left: float) -> Candidate:
    return Candidate(matched_blocks=matched, wait_s=wait, prefill_s=0.1, booked_blocks=booked,
                     held_blocks=matched, left_blocks=left, alone_s=0.1)


def test_holders_passed_over_are_counted_with_how_overbooked_they_were() -> None:
    passed = Decision("a", 3200, chosen=1, busy=True, candidates=[
        _candidate(80, 0.5, booked=100, left=50), _candidate(0, 0.1, booked=10, left=10)],
        ttft_s=0.3)
    kept = Decision("b", 3200, chosen=0, busy=False, candidates=[
        _candidate(80, 0.0, booked=0, left=0), _candidate(0, 0.0, booked=0, left=0)],
        ttft_s=0.11)
    s = summarize([passed, kept], block_size=32)
    assert (s.passed_over, s.passed_over_busy, s.passed_over_overbooked) == (1, 1, 1)
    assert s.passed_over_tokens == 80 * 32
    assert s.waits[(False, 0.0)] == [1, 0.1, 0.3 - 0.1]  # chosen held less, wait under 0.2 s
    assert s.waits[(True, -1.0)] == [1, 0.0, 0.11 - 0.1]
    assert "1 (1 in a busy fleet), 40.0% of the prompt tokens" in report(s)


def test_the_iteration_in_flight_when_a_request_comes_is_recorded() -> None:
    # One worker: a 20k-token cold prompt at 0 (three chunks of 8192 tokens, each one
    # iteration), and 5 ms later a short one, which comes while the first chunk is computed.
    config = SimConfig(workers=1, capacity_tokens=200_000)
    first, second = record([_request("long", 0.0, 1, 20_000),
                            _request("short", 0.005, 900_000, 640)], config)
    assert (first.candidates[0].in_flight_s, first.candidates[0].iteration_s) == (0.0, 0.0)
    came = second.candidates[0]
    chunk_s = config.timing.iteration_ms([(8192, 0)], []) / 1e3
    assert came.iteration_s == pytest.approx(chunk_s)
    assert came.in_flight_s == pytest.approx(chunk_s - 0.005)
    assert second.predicted_s > 0 and second.ttft_s > came.in_flight_s
    s = summarize([first, second], config.block_size)
    assert s.in_flight == 1
    assert s.in_flight_left_s == pytest.approx(chunk_s - 0.005)
    assert "an iteration in flight on the chosen worker: 1 decisions" in report(s)


def test_the_prediction_error_with_the_iteration_left_known() -> None:
    # Predicted 10 ms, delivered 12 ms; the chosen worker's 6 ms iteration had 4 ms left:
    # knowing it, the prediction is 10 - 3 + 4 = 11 ms.
    chosen = Candidate(matched_blocks=0, wait_s=0.002, prefill_s=0.001, booked_blocks=0,
                       held_blocks=0, left_blocks=0, alone_s=0.004, in_flight_s=0.004,
                       iteration_s=0.006)
    idle = Candidate(matched_blocks=0, wait_s=0.0, prefill_s=0.001, booked_blocks=0,
                     held_blocks=0, left_blocks=0, alone_s=0.004)
    decisions = [Decision("a", 640, chosen=0, busy=False, candidates=[chosen], ttft_s=0.012,
                          predicted_s=0.010),
                 Decision("b", 640, chosen=0, busy=False, candidates=[idle], ttft_s=0.005,
                          predicted_s=0.009)]
    s = summarize(decisions, block_size=32)
    assert s.in_flight == 1  # the idle worker's decision is not counted
    assert s.prediction_error == pytest.approx(0.002 / 0.012)
    assert s.phase_known_error == pytest.approx(0.001 / 0.012)
