"""Table-driven tests of the scheduler's cost rule, ties, temperature and tiers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.routing.scheduler import Candidate, SchedulerConfig, choose, cost_of

# Dynamo's rule makes the table's arithmetic easy to follow; the defaults get their own cases.
DEFAULT = SchedulerConfig.dynamo()
ROUTER = SchedulerConfig()


@pytest.mark.parametrize("name, blocks, candidates, config, expected", [
    ("the longest prefix wins when load is equal", 10,
     [Candidate(0, matched_blocks=2, device_matched_blocks=2),
      Candidate(1, matched_blocks=8, device_matched_blocks=8)], DEFAULT, 1),
    # w1: prefill 10-8 + 0 = 2, decode 20 -> 22; w0: prefill 10 + 0, decode 0 -> 10
    ("load outweighs the cache once decode blocks exceed the saving", 10,
     [Candidate(0),
      Candidate(1, matched_blocks=8, device_matched_blocks=8, decode_blocks=20)], DEFAULT, 0),
    # the same, with overlap weight 3: w1 = 3*2 + 20 = 26, w0 = 3*10 = 30 -> the cache wins
    ("a heavier overlap weight prefers the cache", 10,
     [Candidate(0),
      Candidate(1, matched_blocks=8, device_matched_blocks=8, decode_blocks=20)],
     SchedulerConfig(overlap_weight=3.0, queue_weight=1.0), 1),
    ("queued prefill counts against a worker", 10,
     [Candidate(0, matched_blocks=5, device_matched_blocks=5, pending_prefill_blocks=9),
      Candidate(1, matched_blocks=0)], DEFAULT, 1),
    # host match credited 0.75: w0 = 10 - 0.75*8 = 4, w1 = 10 - 5 = 5
    ("host-tier hits are credited less but still count", 10,
     [Candidate(0, matched_blocks=8, device_matched_blocks=0),
      Candidate(1, matched_blocks=5, device_matched_blocks=5)], DEFAULT, 0),
    # with host credit 0.5: w0 = 10 - 4 = 6, w1 = 5 -> device wins
    ("a lower host credit flips that choice", 10,
     [Candidate(0, matched_blocks=8, device_matched_blocks=0),
      Candidate(1, matched_blocks=5, device_matched_blocks=5)],
     SchedulerConfig(overlap_weight=1.0, host_credit=0.5, queue_weight=1.0), 1),
    # queue weight 0.25: w0 = 10 - 5 + 0.25*9 = 7.25 < w1 = 10 -> wait behind the queue
    ("a low queue weight prefers waiting to recomputing", 10,
     [Candidate(0, matched_blocks=5, device_matched_blocks=5, pending_prefill_blocks=9),
      Candidate(1, matched_blocks=0)],
     SchedulerConfig(overlap_weight=1.0, queue_weight=0.25), 0),
    # defaults (32, 0.5): w1 = 32*2 + 20 = 84 < w0 = 32*10 = 320 -> the cache wins
    ("by default a decode load of 20 blocks does not outweigh 8 cached blocks", 10,
     [Candidate(0),
      Candidate(1, matched_blocks=8, device_matched_blocks=8, decode_blocks=20)], ROUTER, 1),
    # defaults: w1 = 32*2 + 300 = 364 > w0 = 320 -> spread
    ("by default a heavy decode load does", 10,
     [Candidate(0),
      Candidate(1, matched_blocks=8, device_matched_blocks=8, decode_blocks=300)], ROUTER, 0),
    ("equal cost goes to fewer active requests", 4,
     [Candidate(0, active_requests=3), Candidate(1, active_requests=1),
      Candidate(2, active_requests=2)], DEFAULT, 1),
    ("an empty prompt is decided on load alone", 0,
     [Candidate(0, decode_blocks=5), Candidate(1, decode_blocks=1)], DEFAULT, 1),
    ("a match longer than the request is capped", 3,
     [Candidate(0, matched_blocks=9, device_matched_blocks=9, decode_blocks=1),
      Candidate(1, matched_blocks=3, device_matched_blocks=3)], DEFAULT, 1),
])
def test_choice(name: str, blocks: int, candidates: list[Candidate], config: SchedulerConfig,
                expected: int) -> None:
    decision = choose(blocks, candidates, config, random.Random(0))
    assert decision.worker == expected, name
    assert decision.costs[0].cost <= decision.costs[-1].cost


def test_cost_terms_are_reported() -> None:
    terms = cost_of(Candidate(4, matched_blocks=6, device_matched_blocks=2,
                              pending_prefill_blocks=3, decode_blocks=7, active_requests=2),
                    10, SchedulerConfig(overlap_weight=2.0, host_credit=0.5, queue_weight=0.5))
    # credited = 2 + 0.5*4 = 4; prefill = 10 - 4 + 0.5*3 = 7.5; cost = 2*7.5 + 7 = 22
    assert (terms.credited_blocks, terms.prefill_blocks, terms.cost) == (4.0, 7.5, 22.0)


def test_full_ties_are_broken_at_random_over_all_tied() -> None:
    rng = random.Random(1)
    picks = Counter(choose(4, [Candidate(w) for w in range(3)], DEFAULT, rng).worker
                    for _ in range(300))
    assert set(picks) == {0, 1, 2}
    assert min(picks.values()) > 60


def test_a_clear_winner_does_not_depend_on_the_random_source() -> None:
    cands = [Candidate(0, matched_blocks=3, device_matched_blocks=3), Candidate(1)]
    assert {choose(10, cands, DEFAULT, random.Random(s)).worker for s in range(20)} == {0}


@pytest.mark.parametrize("kwargs", [{"overlap_weight": -1}, {"host_credit": 1.5},
                                    {"queue_weight": -0.5}, {"queue_weight": float("nan")}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_no_candidates_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        choose(3, [], DEFAULT, random.Random(0))


# Sessions: worker 1 holds none of a 10-block prompt but is idle; worker 0 holds it all and
# has 100 blocks queued. At weight 1 leaving costs 10 blocks against 100 queued: by cost, 1.
BUSY_HOME = [Candidate(0, matched_blocks=10, device_matched_blocks=10,
                       pending_prefill_blocks=100.0),
             Candidate(1)]


@pytest.mark.parametrize("name, queue_blocks, home, expected", [
    ("a continuation stays home while its queue is within the limit", 128.0, 0, 0),
    ("and leaves by cost when the queue is past it", 64.0, 0, 1),
    ("a home that is not a candidate leaves the choice to the costs", 128.0, 5, 1),
    ("without a home the costs decide", 128.0, None, 1),
])
def test_a_continuing_session_stays_home_unless_its_queue_runs_away(
        name: str, queue_blocks: float, home: int | None, expected: int) -> None:
    config = SchedulerConfig(overlap_weight=1.0, queue_weight=1.0,
                             session_queue_blocks=queue_blocks)
    decision = choose(10, BUSY_HOME, config, random.Random(0), home=home)
    assert decision.worker == expected, name
    assert sorted(c.worker for c in decision.costs) == [0, 1]  # every candidate still priced


def test_the_queue_limit_counts_from_the_shortest_queue() -> None:
    both_busy = [Candidate(0, matched_blocks=10, device_matched_blocks=10,
                           pending_prefill_blocks=150.0),
                 Candidate(1, pending_prefill_blocks=100.0)]
    config = SchedulerConfig(overlap_weight=1.0, queue_weight=1.0, session_queue_blocks=64.0)
    assert choose(10, both_busy, config, random.Random(0), home=0).worker == 0  # 50 past


@pytest.mark.parametrize("rate, expected", [(1.0, 1), (0.25, 1), (0.02, 0), (0.0, 0)])
def test_sessions_already_on_a_worker_count_against_it(rate: float, expected: int) -> None:
    # Worker 0 holds 2 blocks of the prompt (32 x 8 = 256 against 32 x 10 = 320) and 3 more
    # sessions, each 32 x 16 x rate: 1536 at rate 1, 384 at 0.25 (both leave), 30.7 at 0.02
    # (stays), and nothing where no session ever continued.
    candidates = [Candidate(0, matched_blocks=2, device_matched_blocks=2, sessions=3),
                  Candidate(1, sessions=0)]
    config = SchedulerConfig(session_weight=16.0)
    decision = choose(10, candidates, config, random.Random(0), continue_rate=rate)
    assert decision.worker == expected
    assert {c.worker: c.sessions for c in decision.costs} == {0: 3, 1: 0}
    assert decision.chosen.cost == (256.0 + 32 * 16 * rate * 3 if expected == 0 else 320.0)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"session_weight": -1.0}, "session_weight"), ({"session_weight": float("nan")},
                                                   "session_weight"),
    ({"session_queue_blocks": -1.0}, "session_queue_blocks")])
def test_bad_session_settings_are_refused(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
