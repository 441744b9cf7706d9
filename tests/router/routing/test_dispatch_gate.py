"""The dispatch gate's pure parts: the room kept for the urgent, each worker's limit of
sequences (said or learned), the fleet's measured drain rate, and the bound they set on a
request that must wait (times are passed in: no clock)."""

from __future__ import annotations

import pytest

from router.routing.admission import FlowQueue, FlowSettings, Waiting
from router.routing.dispatch_gate import CompletionRate, SeqLimits, reserved, starts_soon


def test_the_urgent_share_keeps_at_least_one_sequence_and_never_all() -> None:
    assert reserved(32, 0.0625) == 2
    assert reserved(4, 0.0625) == 1  # at least one
    assert reserved(2, 0.9) == 1  # never every sequence
    assert reserved(32, 0.0) == 0 and reserved(1, 0.5) == 0 and reserved(0, 0.5) == 0


def test_a_worker_starts_a_request_only_below_its_limit_less_the_room_kept() -> None:
    assert starts_soon(31, 32, 0) and not starts_soon(32, 32, 0)
    assert starts_soon(29, 32, 2) and not starts_soon(30, 32, 2)
    assert starts_soon(1000, 0, 2)  # unknown limit: the gate is open


def test_a_said_limit_is_the_limit_whatever_the_reports_say() -> None:
    limits = SeqLimits()
    limits.held(1)
    limits.reported(1, running=5, waiting=3)
    assert limits.limit(1, 32) == 32


def test_a_stock_engines_limit_is_learned_from_its_queue_and_grows_back() -> None:
    limits = SeqLimits()
    assert limits.limit(7, 0) == 0  # unknown until it queues
    limits.reported(7, running=3, waiting=0)
    assert limits.limit(7, 0) == 0
    limits.reported(7, running=8, waiting=2)  # it queued with 8 running: 8 at most
    assert limits.limit(7, 0) == 8
    limits.reported(7, running=8, waiting=1)  # queued, but the router held nothing back:
    assert limits.limit(7, 0) == 8  # its own arrivals, or foreign ones; kept
    limits.held(7)  # held back at 8, and it had none waiting: 8 + 8 // 4
    limits.reported(7, running=8, waiting=0)
    assert limits.limit(7, 0) == 10
    limits.reported(7, running=10, waiting=0)  # not held since: unchanged
    assert limits.limit(7, 0) == 10
    limits.held(7)
    limits.reported(7, running=9, waiting=2)  # held back and still queuing: what runs
    assert limits.limit(7, 0) == 9
    limits.held(7)
    limits.reported(7, running=0, waiting=4)  # never below one
    assert limits.limit(7, 0) == 1
    limits.forget(7)
    assert limits.limit(7, 0) == 0


def test_the_drain_rate_is_ends_per_second_and_slows_when_ends_stop() -> None:
    rate = CompletionRate(window=8)
    for t in (0.0, 0.5, 1.0):
        rate.ended(t)
    assert rate.per_second(1.0) is None  # too few ends to say
    rate.ended(1.5)
    assert rate.per_second(2.0) == pytest.approx(4 / 2.0)
    for i in range(8):  # the window keeps the last 8: 2.0 .. 5.5, one every 0.5 s
        rate.ended(1.5 + 0.5 * (i + 1))
    assert rate.per_second(5.5) == pytest.approx(8 / 3.5)
    assert rate.per_second(15.5) == pytest.approx(8 / 13.5)  # nothing ended since
    with pytest.raises(ValueError):
        CompletionRate(window=1)


def _low(key: str, priority: int = 10, deadline: float | None = None) -> Waiting:
    return Waiting(key, priority, "", 100, 0.0, deadline)


def test_a_request_predicted_past_its_budget_at_the_measured_pace_is_refused_at_once() -> None:
    settings = FlowSettings(ttft_budget_s=30.0)
    q = FlowQueue(settings)
    budget = settings.waiting_deadline(10, 0.0, None)
    assert budget == 30.0
    # 10 ends a second: the 200 waiting leave in 20 s; one more waits 20.1 s, with 1 s of
    # TTFT: 21.1 s, within 30.
    for i in range(200):
        assert q.offer(_low(f"w{i}", deadline=budget), 0.0, 1.0, 1e-6, 0.1).refused is None
    assert q.offer(_low("in", deadline=budget), 0.0, 1.0, 1e-6, 0.1).refused is None
    # At 5 ends a second the next waits 40.4 s, and 1 s more: refused, told to come back
    # when the prediction would be met (the time it predicts, rounded up).
    offer = q.offer(_low("late", deadline=budget), 0.0, 1.0, 1e-6, 0.2)
    assert offer.refused is not None and offer.refused.reason == "deadline"
    assert offer.refused.retry_after_s == 42
    assert "late" not in q
    # An urgent request has nothing ahead of it: admitted at the same pace.
    assert q.offer(_low("urgent", priority=0, deadline=budget), 0.0, 1.0, 1e-6, 0.2
                   ).refused is None
    # Without a measured pace the old estimate stands: tokens ahead at the prefill's rate.
    assert q.offer(_low("unmeasured", deadline=budget), 0.0, 1.0, 1e-6).refused is None


def test_the_budget_is_a_deadline_only_where_none_is_set() -> None:
    settings = FlowSettings(ttft_budget_s=20.0, deadlines={0: 2.0})
    assert settings.waiting_deadline(0, 100.0, None) == 102.0
    assert settings.waiting_deadline(0, 100.0, 0.5) == 100.5
    assert settings.waiting_deadline(5, 100.0, None) == 120.0
    assert FlowSettings(ttft_budget_s=0.0).waiting_deadline(5, 100.0, None) is None
    assert settings.deadline(5, 100.0, None) is None  # a request sent at once has none


@pytest.mark.parametrize("bad", [{"ttft_budget_s": -1.0}, {"urgent_share": 1.0},
                                 {"urgent_share": float("nan")},
                                 {"ttft_budget_s": float("inf")}])
def test_bad_gate_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FlowSettings(**bad)  # type: ignore[arg-type]


def test_a_full_fleets_pace_is_its_sequences_over_the_time_each_is_held() -> None:
    rate = CompletionRate(window=8)
    for key in "abcd":
        rate.started(key, 0.0)
    for key in "abcd":
        rate.ended(1.0, key)  # each held its sequence 1 s
    # 4 ends in the second since the first: 4 a second; 16 sequences taken, each held 1 s:
    # 16 a second, which the ends seen alone cannot show at a flood's onset.
    assert rate.per_second(2.0) == pytest.approx(4.0)
    assert rate.per_second(2.0, sequences=16) == pytest.approx(16.0)
    for key in "efgh":
        rate.started(key, 1.0)
    # At 5 s those four have held theirs 4 s and not ended: a sequence is held 4 s at least.
    assert rate.per_second(5.0, sequences=16) == pytest.approx(16 / 4.0)
    assert rate.per_second(5.0) == pytest.approx(4 / 4.0)
    rate.ended(6.0, "unknown")  # an end not started here counts as an end, holds nothing
    assert rate.per_second(6.0, sequences=16) == pytest.approx(16 / 5.0)


def test_a_waiting_request_whose_wait_grew_past_its_deadline_is_shed_before_it() -> None:
    q = FlowQueue(FlowSettings())
    for i in range(5):  # admitted at 1 s apart: the fifth expects 5 s + 1 s, within 10
        assert q.offer(_low(f"w{i}", deadline=10.0), 0.0, 1.0, 1e-6, 1.0).refused is None
    assert q.offer(_low("urgent", priority=0, deadline=10.0), 0.0, 1.0, 1e-6, 1.0
                   ).refused is None
    # At 2 s the pace has slowed to one leaving every 2 s: the urgent one leaves first, its
    # first token at 2 + 2 + 1 = 5 s; the lows' at 7, 9, 11, 13, 15 s, and a shed one frees
    # its place: w2 at 11 s is past 10 s, so w3 and w4 take its place, still past: all three
    # are told now, not at 10 s.
    shed = q.expire(2.0, 1.0, 2.0)
    assert sorted(s.key for s in shed) == ["w2", "w3", "w4"]
    assert all(s.reason == "deadline" and s.retry_after_s >= 1 for s in shed)
    assert [q.pop().key for _ in range(3)] == ["urgent", "w0", "w1"]  # type: ignore[union-attr]
    # Without a pace only the deadline itself sheds.
    assert q.offer(_low("x", deadline=10.0), 2.0, 1.0, 1e-6).refused is None
    assert q.expire(2.0, 1.0) == [] and q.expire(9.5, 1.0)[0].key == "x"


def test_a_flood_of_long_requests_is_paced_by_the_tokens_they_ask_before_any_ends() -> None:
    rate = CompletionRate(window=8)
    for i in range(4):  # the load before the flood: 16-token chats, each held 0.25 s
        rate.started(f"s{i}", 0.0, asked=16)
        rate.ended(0.25, f"s{i}")
    # 0.25 s for 16 tokens asked: 1/64 s a token. 60 chats of 400 tokens take the 60
    # sequences at 1 s; at 2 s none has ended, and none is older than 1 s.
    for i in range(60):
        rate.started(f"long{i}", 1.0, asked=400)
    # Their ages say 60 a second; what they asked says 400 / 64 = 6.25 s each: 9.6 a second.
    assert rate.per_second(2.0, sequences=60) == pytest.approx(60 / 6.25)
    # Requests that name no limit are paced by their ages alone, as before.
    plain = CompletionRate(window=8)
    for i in range(4):
        plain.started(f"s{i}", 0.0)
        plain.ended(0.25, f"s{i}")
    for i in range(60):
        plain.started(f"long{i}", 1.0)
    assert plain.per_second(2.0, sequences=60) == pytest.approx(60 / 1.0)
    # Calibrated on what the ended ones took of what they asked: chats asking 400 that end
    # after 0.5 s (they stopped short) teach 1/800 s a token, and the pace follows.
    for i in range(60):
        rate.ended(1.5, f"long{i}")
    for i in range(60):
        rate.started(f"next{i}", 1.5, asked=400)
    assert rate.per_second(1.6, sequences=60) == pytest.approx(60 / 0.5)
