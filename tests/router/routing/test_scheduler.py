"""The rule in seconds (:mod:`router.routing.scheduler`): exact prices and choices for small
fleets whose rates are round numbers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.routing.rates import Rates
from router.routing.scheduler import Candidate, Decision, FetchSource, choose, cost_of

#: A block of prefill costs 1 s, a block of decode context 0.01 s, a host block 0.25 s.
R = Rates(prefill_s=1.0, decode_s=0.01, onboard_s=0.25)
#: The same with attention: each new block costs 0.001 s per block of context before it.
A = Rates(prefill_s=1.0, context_s=0.001, onboard_s=0.25, first_s=0.5)


@pytest.mark.parametrize("name, blocks, candidates, expected", [
    ("more cached wins", 10,
     [Candidate(0, matched_blocks=2, device_matched_blocks=2, rates=R),
      Candidate(1, matched_blocks=8, device_matched_blocks=8, rates=R)], 1),
    ("a wait longer than the recompute loses", 10,
     [Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=10.5, rates=R),
      Candidate(1, rates=R)], 1),
    ("a wait shorter than the recompute is worth it", 10,
     [Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=9.5, rates=R),
      Candidate(1, rates=R)], 0),
    ("a host hit costs its copy: 8 host blocks (2 s + 2 s) beat 5 device (5 s)", 10,
     [Candidate(0, matched_blocks=8, device_matched_blocks=0, rates=R),
      Candidate(1, matched_blocks=5, device_matched_blocks=5, rates=R)], 0),
    ("a faster worker recomputes sooner than a slow one holding half", 10,
     [Candidate(0, matched_blocks=5, device_matched_blocks=5,
                rates=Rates(prefill_s=3.0)),
      Candidate(1, rates=R)], 1),
    ("a match longer than the request is capped", 3,
     [Candidate(0, matched_blocks=9, device_matched_blocks=9, wait_s=0.01, rates=R),
      Candidate(1, matched_blocks=3, device_matched_blocks=3, rates=R)], 1),
    ("no full block: the shorter wait", 0,
     [Candidate(0, wait_s=2.0, rates=R), Candidate(1, wait_s=1.0, rates=R)], 1),
])
def test_choice(name: str, blocks: int, candidates: list[Candidate], expected: int) -> None:
    decision = choose(blocks, candidates, random.Random(0))
    assert decision.worker == expected, name
    assert [c.cost for c in decision.costs] == sorted(c.cost for c in decision.costs)


def test_the_terms_are_seconds() -> None:
    terms = cost_of(Candidate(4, matched_blocks=6, device_matched_blocks=2, wait_s=3.0,
                              rates=A, pending_prefill_blocks=3, decode_blocks=7,
                              active_requests=2), 10)
    # 4 new blocks after 6 held: 4 s + 0.001 x 4 x (6 + 2) = 4.032 s; 4 host copies 1 s.
    assert terms.prefill_blocks == 4 and terms.prefill_s == pytest.approx(5.032)
    assert terms.cost == pytest.approx(3.0 + 5.032 + 0.5)
    assert (terms.pending_prefill_blocks, terms.decode_blocks, terms.active_requests) == (3, 7, 2)


def test_full_ties_are_broken_at_random_over_all_tied() -> None:
    rng = random.Random(1)
    picks = Counter(choose(4, [Candidate(w, rates=R) for w in range(3)], rng).worker
                    for _ in range(300))
    assert set(picks) == {0, 1, 2}
    assert min(picks.values()) > 60


def test_ties_go_to_fewer_active_requests_first() -> None:
    candidates = [Candidate(0, active_requests=3), Candidate(1, active_requests=1),
                  Candidate(2, active_requests=2)]
    assert {choose(4, candidates, random.Random(s)).worker for s in range(20)} == {1}


def test_a_clear_winner_does_not_depend_on_the_random_source() -> None:
    cands = [Candidate(0, matched_blocks=3, device_matched_blocks=3), Candidate(1)]
    assert {choose(10, cands, random.Random(s)).worker for s in range(20)} == {0}


def test_no_candidates_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        choose(3, [], random.Random(0))


def test_a_decision_without_costs_or_a_way_to_them_is_refused() -> None:
    with pytest.raises(ValueError, match="needs its costs"):
        Decision(0)


def test_a_fallbacks_terms_are_found_by_worker() -> None:
    decision = choose(10, [Candidate(0, matched_blocks=4, device_matched_blocks=4),
                           Candidate(1)], random.Random(0))
    assert decision.terms(1).prefill_blocks == 10 and decision.terms(0) is decision.chosen


@pytest.mark.parametrize("kwargs, fragment", [
    ({"prefill_s": -1.0}, "prefill_s"), ({"context_s": float("nan")}, "context_s"),
    ({"decode_s": float("inf")}, "decode_s"), ({"onboard_s": 2.0}, "onboard_s must not"),
])
def test_bad_rates_are_refused(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        Rates(**{"prefill_s": 1.0, **kwargs})


def test_a_busy_fleet_prices_the_prefill_passed_on() -> None:
    # No candidate is idle: each one's prefill is priced again, as the wait it passes on.
    holder = Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=12.0, rates=R)
    other = Candidate(1, wait_s=0.5, rates=R)
    decision = choose(10, [holder, other], random.Random(0))
    # The holder: 12 s + 0 s of prefill; the other: 0.5 s + 10 s, and 10 s passed on.
    assert decision.worker == 0
    terms = {c.worker: c for c in decision.costs}
    assert (terms[0].cost, terms[0].price) == (12.0, 12.0)
    assert (terms[1].cost, terms[1].price) == (10.5, 20.5)


def test_a_recompute_is_passed_on_to_as_many_requests_as_its_candidate_says() -> None:
    # The holder queued 21 s, the other with requests prefilling: three later
    # requests would wait for its 10 s recompute, so the holder is the lesser price.
    holder = Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=21.0, rates=R,
                       passed_on=3.0)
    other = Candidate(1, wait_s=0.5, rates=R, passed_on=3.0)
    terms = {c.worker: c for c in choose(10, [holder, other], random.Random(0)).costs}
    assert (terms[0].cost, terms[0].price) == (21.0, 21.0)
    assert (terms[1].cost, terms[1].price) == (10.5, 40.5)
    assert choose(10, [holder, other], random.Random(0)).worker == 0
    other.passed_on = 1.0  # nothing prefilling there: one later request waits for it
    assert choose(10, [holder, other], random.Random(0)).worker == 1


def test_with_an_idle_candidate_nothing_is_passed_on() -> None:
    # The same holder against an idle worker: its own time decides (invariant 2).
    holder = Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=12.0, rates=R)
    decision = choose(10, [holder, Candidate(1, rates=R)], random.Random(0))
    assert decision.worker == 1
    assert all(c.price == c.cost for c in decision.costs)


def test_a_busy_fleet_still_leaves_a_queue_longer_than_two_recomputes() -> None:
    holder = Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=21.0, rates=R)
    assert choose(10, [holder, Candidate(1, wait_s=0.5, rates=R)], random.Random(0)).worker == 1


def test_within_an_objective_a_busy_fleet_waits_for_the_hit() -> None:
    # The holder: 12 s queued, nothing to prefill; the other: 0.5 s queued, a 10 s recompute.
    # Without an objective the holder wins already (12 s against 10.5 + 10 passed on); with
    # it the holder's price is its prefill, 0 s, and it wins while its TTFT is within.
    holder = Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=12.0, rates=R)
    other = Candidate(1, wait_s=0.5, rates=R, passed_on=0.1)
    assert choose(10, [holder, other], random.Random(0)).worker == 1  # 12 > 10.5 + 1
    decision = choose(10, [holder, other], random.Random(0), slo=12.0)
    assert decision.worker == 0
    terms = {c.worker: c for c in decision.costs}
    assert (terms[0].price, terms[0].within_slo) == (0.0, True)
    assert (terms[1].price, terms[1].within_slo) == (10.0, True)  # its own prefill
    # Past the objective the holder is priced by the rule, above any candidate within it.
    decision = choose(10, [holder, other], random.Random(0), slo=11.0)
    assert decision.worker == 1
    terms = {c.worker: c for c in decision.costs}
    assert (terms[0].price, terms[0].within_slo) == (12.0, False)
    assert (terms[1].price, terms[1].within_slo) == (10.0, True)


def test_within_an_objective_equal_prefill_goes_to_the_sooner_worker() -> None:
    # Neither holds anything: the same 10 s of prefill; the shorter queue answers sooner.
    fleet = [Candidate(0, wait_s=3.0, rates=R), Candidate(1, wait_s=0.5, rates=R),
             Candidate(2, wait_s=1.0, rates=R)]
    for seed in range(10):
        assert choose(10, fleet, random.Random(seed), slo=20.0).worker == 1


def test_an_objective_changes_nothing_while_a_worker_is_idle() -> None:
    holder = Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=12.0, rates=R)
    decision = choose(10, [holder, Candidate(1, rates=R)], random.Random(0), slo=100.0)
    assert decision.worker == 1  # the idle recompute is sooner: invariant 2
    assert all(c.price == c.cost and not c.within_slo for c in decision.costs)


def test_a_worker_fetches_what_a_busy_holder_holds_instead_of_recomputing_it() -> None:
    """Worker 0 holds 100 of 120 blocks on its device behind 5 s of queue; worker 1 is idle
    and holds nothing. Over a link of 1 ms a block (plus 2 ms a read) worker 1 fetches the
    100 blocks and prefills 20: 0.102 s + 20 s of prefill, against 120 s recomputed there
    and 5 s + 20 s at the holder."""
    rates = Rates(prefill_s=1.0)
    holder = Candidate(0, matched_blocks=100, device_matched_blocks=100, wait_s=5.0,
                       rates=rates)
    source = FetchSource(0, 100, block_s=0.001, read_s=0.002)
    taker = Candidate(1, rates=rates, sources=(source,))
    decision = choose(120, [holder, taker], random.Random(0))
    assert decision.worker == 1
    chosen = decision.chosen
    assert chosen.fetch_source == 0 and chosen.fetch_blocks == 100
    assert chosen.fetch_s == pytest.approx(0.102)
    assert chosen.prefill_blocks == 20 and chosen.prefill_s == 20.0
    assert chosen.cost == pytest.approx(20.102) and chosen.recompute_cost == 120.0
    assert decision.terms(0).cost == 25.0  # waiting for the holder: its own row
    # A link slower than recomputing: 1.1 s a block moves 100 blocks in 110 s, dearer than
    # the 100 s of prefill it saves; worker 1 recomputes, and the holder wins.
    slow = Candidate(1, rates=rates, sources=(FetchSource(0, 100, 1.1),))
    decision = choose(120, [holder, slow], random.Random(0))
    assert decision.worker == 0
    assert decision.terms(1).fetch_source is None
    assert decision.terms(1).fetch_price == pytest.approx(130.0)  # shown, not chosen


def test_a_busy_fleet_passes_on_a_fetchs_prefill_not_its_transfer() -> None:
    """In a busy fleet a fetch's price is its TTFT plus its prefill passed on; the transfer
    is in the TTFT once."""
    rates = Rates(prefill_s=1.0)
    taker = Candidate(1, wait_s=1.0, rates=rates, passed_on=2.0,
                      sources=(FetchSource(0, 10, block_s=0.5),))
    holder = Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=50.0,
                       rates=rates)
    terms = choose(12, [holder, taker], random.Random(0)).terms(1)
    assert terms.fetch_source == 0
    assert terms.cost == 1.0 + 5.0 + 2.0  # wait, transfer, prefill of the 2 blocks left
    assert terms.price == terms.cost + 2.0 * 2.0


def test_under_eviction_pressure_a_busy_fleet_prices_a_fetched_copy_as_passed_on() -> None:
    """A fetch's copy evicts blocks once the caches are full: in a busy fleet its blocks'
    prefill is passed on in the share of the pressure. At 0 the copy is free and the taker
    fetches; at 1 it costs what recomputing would, and the holder's shorter queue wins."""
    rates = Rates(prefill_s=1.0)
    holder = Candidate(0, matched_blocks=10, device_matched_blocks=10, wait_s=3.0,
                       rates=rates)
    taker = Candidate(1, wait_s=1.0, rates=rates, sources=(FetchSource(0, 10, block_s=0.1),))
    free = choose(12, [holder, taker], random.Random(0))
    assert free.worker == 1 and free.chosen.price == (1.0 + 1.0 + 2.0) + 2.0
    full = choose(12, [holder, taker], random.Random(0), pressure=1.0)
    assert full.worker == 0  # 3 + 2 + 2 = 7 against 4 + (2 + 10) = 16
    assert full.terms(1).fetch_price == 4.0 + (2.0 + 10.0)
    idle = Candidate(1, rates=rates, sources=(FetchSource(0, 10, block_s=0.1),))
    assert choose(12, [holder, idle], random.Random(0), pressure=1.0).terms(1).price == 3.0
