"""The session tracker: which request continues which, where sessions live, when they end."""

from __future__ import annotations

import pytest

from router.routing.sessions import SessionTracker

TURN1 = [11, 12, 13]
TURN2 = [11, 12, 13, 21, 22]  # turn 1's prompt, its reply, a new message
TURN3 = [11, 12, 13, 21, 22, 31]


def test_a_request_holding_an_earlier_prompt_continues_its_session() -> None:
    s = SessionTracker()
    assert s.continuation(TURN1, 0.0) is None
    s.routed(TURN1, worker=2, now=0.0)
    found = s.continuation(TURN2, 1.0)
    assert found is not None and (found.worker, found.key, found.routed_at) == (2, 13, 0.0)
    assert s.continuation([11, 12, 99], 1.0) is None  # shares a prefix, not the last block
    assert s.continuation(TURN1, 1.0) is None  # the same prompt again is not a continuation


def test_a_follow_up_too_short_to_fill_a_block_continues_but_a_retry_does_not() -> None:
    s = SessionTracker()
    s.routed(TURN1, worker=1, now=0.0, tokens=100)  # 3 full blocks and a partial one
    short = s.continuation(TURN1, 1.0, tokens=120)  # "ok": the same full blocks, more text
    assert short is not None and (short.worker, short.key) == (1, 13)
    assert s.continuation(TURN1, 1.0, tokens=100) is None  # the same prompt again


def test_the_longest_live_head_wins() -> None:
    s = SessionTracker()
    s.routed(TURN1, worker=0, now=0.0)
    s.routed(TURN2, worker=1, now=0.5)  # a branch: turn 1's head is still live
    found = s.continuation(TURN3, 1.0)
    assert found is not None and (found.worker, found.key) == (1, 22)


def test_a_continuation_moves_the_session_and_counts_once() -> None:
    s = SessionTracker()
    s.routed(TURN1, worker=0, now=0.0)
    assert (s.live(0), s.live(1)) == (1, 0)
    found = s.continuation(TURN2, 2.0)
    s.routed(TURN2, worker=1, now=2.0, continued=found)
    assert (s.live(0), s.live(1), len(s)) == (0, 1, 1)
    assert s.mean_gap == 2.0 and s.continue_rate == 1.0
    # A fallback dispatch of the same request: the head moves, no second outcome.
    s.routed(TURN2, worker=0, now=2.1)
    assert (s.live(0), s.live(1), len(s), s.continue_rate) == (1, 0, 1, 1.0)


def test_heads_expire_after_a_multiple_of_the_mean_gap() -> None:
    s = SessionTracker(expiry_gaps=4.0, initial_expiry_s=10.0)
    s.routed(TURN1, worker=0, now=0.0)
    assert s.expiry_s == 10.0  # no gap seen yet
    s.routed(TURN2, worker=0, now=1.0, continued=s.continuation(TURN2, 1.0))  # gap 1 s
    assert s.expiry_s == 4.0
    s.routed([5, 6], worker=1, now=9.0)
    assert s.continuation([5, 6, 7], 12.0) is not None  # routed at 9.0: 3 s old
    assert s.continuation(TURN3, 12.0) is None  # routed at 1.0: 11 s old, ended
    assert (s.live(0), s.live(1)) == (0, 1)
    assert s.continue_rate == pytest.approx(1 / 2)


def test_the_oldest_heads_go_past_max_heads() -> None:
    s = SessionTracker(max_heads=2)
    for i in range(3):
        s.routed([i, 100 + i], worker=i, now=float(i))
    assert len(s) == 2 and s.live(0) == 0 and s.continue_rate == 0.0
    assert s.continuation([0, 100, 7], 3.0) is None
    assert s.continuation([2, 102, 7], 3.0) is not None


def test_forgetting_a_worker_drops_its_sessions() -> None:
    s = SessionTracker()
    s.routed(TURN1, worker=0, now=0.0)
    s.routed([5, 6], worker=1, now=0.0)
    s.forget(0)
    assert s.continuation(TURN2, 1.0) is None and s.live(0) == 0 and s.live(1) == 1
    s.routed(TURN2, worker=1, now=1.0)  # the next turn starts afresh
    assert s.live(1) == 2


def test_back_to_back_requests_do_not_end_every_session() -> None:
    s = SessionTracker(expiry_gaps=8.0, min_expiry_s=1.0)
    s.routed(TURN1, worker=0, now=5.0)
    s.routed(TURN2, worker=0, now=5.0, continued=s.continuation(TURN2, 5.0))  # gap 0
    assert s.expiry_s == 1.0
    assert s.continuation(TURN3, 5.5) is not None


def test_the_continue_rate_follows_a_changing_workload() -> None:
    s = SessionTracker(initial_expiry_s=1.0, rate_window=8)
    t = 0.0
    for i in range(8):  # chats: every head continued
        s.routed([i], worker=0, now=t)
        s.routed([i, 50 + i], worker=0, now=t, continued=s.continuation([i, 50 + i], t))
        t += 0.01
    assert s.continue_rate > 0.5
    for i in range(40):  # then single requests: every head ends
        t += 10.0
        s.routed([1000 + i], worker=0, now=t)
        s.continuation([], t)
    assert s.continue_rate < 0.1


@pytest.mark.parametrize("kwargs", [
    {"expiry_gaps": 0.0}, {"initial_expiry_s": -1.0}, {"min_expiry_s": -1.0}, {"max_heads": 0},
    {"rate_window": 1}, {"gap_smoothing": 0.0}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SessionTracker(**kwargs)  # type: ignore[arg-type]
