"""Scenarios through :class:`router.routing.core.RoutingCore`: where a prefix everyone shares
goes on an idle pair, that live sessions never outweigh a certain hit, and that requests
cached behind a giant cold prefill do not wait for it."""

from __future__ import annotations

import random

import pytest

from indexer.events import Stored
from router.routing.core import CoreSettings, RoutingCore
from router.routing.fetch_links import FetchAbility
from router.routing.load import ReportedLoad
from router.routing.scheduler import WorkerCost


def _idle_pair() -> RoutingCore:
    core = RoutingCore(CoreSettings())
    for w in (0, 1):
        core.worker_joined(w)
    return core


def _route(core: RoutingCore, name: str, hashes: list[int], now: float,
           rng: random.Random) -> int:
    routed = core.decide(hashes, {}, now, rng, tokens=32 * len(hashes) + 1)
    worker = routed.decision.worker
    core.routed(name, worker, hashes, routed.decision.chosen, now, routed.continued,
                32 * len(hashes) + 1)
    core.first_token(name, now)
    core.finished(name)
    return worker


def test_requests_sharing_only_a_prefix_all_go_to_its_holder() -> None:
    # Twelve requests: one 12-block prefix, then 4 blocks of their own. None holds another's
    # last block, so none continues a session and the session term is 0: after the first
    # (a tie, drawn), the predicted prefix keeps every one on the same worker.
    core, rng = _idle_pair(), random.Random(0)
    prefix = list(range(1, 13))
    workers = [_route(core, f"r{i}", prefix + [1000 + 10 * i + j for j in range(4)],
                      0.1 * i, rng) for i in range(12)]
    assert workers == [workers[0]] * 12
    assert core.follows_sessions and core.continue_rate == 0.0


def test_an_idle_holder_wins_however_many_sessions_it_holds() -> None:
    # Both workers idle; worker 0 holds a whole 8-block prompt and four live conversations,
    # worker 1 none of it and one conversation. Sessions are a forecast, the hit is certain:
    # the holder wins (a repeat of a chat is served from its cache).
    core, rng = _idle_pair(), random.Random(0)
    for i in range(4):
        core.routed(f"c{i}", 0, [500 + 10 * i, 501 + 10 * i], _terms(core, 0), 0.0, None, 65)
        core.finished(f"c{i}")
    core.routed("c9", 1, [900, 901], _terms(core, 1), 0.0, None, 65)
    core.finished("c9")
    assert (core.live_sessions(0), core.live_sessions(1)) == (4, 1)
    prompt = list(range(1, 9))
    routed = core.decide(prompt, {0: (8, 8)}, 1.0, rng, tokens=8 * 32 + 1)
    assert routed.decision.worker == 0
    assert routed.decision.terms(1).cost > routed.decision.terms(0).cost


def _terms(core: RoutingCore, worker: int) -> WorkerCost:
    """The terms of an empty request on ``worker`` (to book one there by hand)."""
    return core.decide([], {}, 0.0, random.Random(0), workers=[worker]).decision.chosen


def test_requests_cached_behind_a_giant_cold_prefill_do_not_queue_behind_it() -> None:
    # Four idle workers at the default rates. A 191k-token prompt nobody holds (5,970
    # blocks) goes to one of them: about 8 s of prefill, mostly attention. Then five requests
    # of 60k tokens whose first 52k (1,625 blocks) that worker holds (from earlier traffic)
    # arrive while it is still prefilling. Waiting there costs the giant's 8 s; recomputing
    # all 60k elsewhere under 1 s: each goes elsewhere. The rule in blocks with the queue
    # discounted (0.1 x 5,970 queued against 1,875 to recompute) sent them all to wait.
    core = RoutingCore(CoreSettings())
    for w in range(4):
        core.worker_joined(w)
    rng = random.Random(7)
    giant = list(range(10_000, 10_000 + 5_970))
    routed = core.decide(giant, {}, 0.0, rng, tokens=191_040)
    holder = routed.decision.worker
    core.routed("giant", holder, giant, routed.decision.chosen, 0.0, routed.continued,
                191_040)
    assert core.wait(holder) > 7.0
    shared = list(range(1, 1_626))
    for i in range(5):
        prompt = shared + [100_000 + 1_000 * i + j for j in range(250)]
        routed = core.decide(prompt, {holder: (1_625, 1_625)}, 0.1 * (i + 1), rng,
                             tokens=len(prompt) * 32)
        chosen = routed.decision.chosen
        assert routed.decision.worker != holder, f"request {i} queued behind the giant"
        assert chosen.cost < 2.0 < routed.decision.terms(holder).cost
        core.routed(f"r{i}", routed.decision.worker, prompt, chosen, 0.1 * (i + 1),
                    routed.continued, len(prompt) * 32)
    # Once the giant's first token is out, its worker is idle again and the hit wins.
    core.first_token("giant", 8.5)
    prompt = shared + list(range(200_000, 200_250))
    routed = core.decide(prompt, {holder: (1_625, 1_625)}, 9.0, rng, tokens=len(prompt) * 32)
    assert routed.decision.worker == holder


def test_a_holder_part_way_through_a_long_prefill_is_priced_at_what_is_left() -> None:
    # Worker 0 holds a 40k-token prefix and is prefilling a 100k-token cold prompt (3,125
    # blocks, about 2.5 s at the default rates); worker 1 is busy with a short one. Booked
    # whole, worker 0's wait is over the recompute elsewhere, so a question on the prefix
    # goes to worker 1. Once worker 0's events show 2,900 of the cold prompt's blocks stored,
    # what is left of it is a fraction of the recompute, and the question goes to the holder.
    core = RoutingCore(CoreSettings())
    for w in (0, 1):
        core.worker_joined(w)
    rng = random.Random(5)
    cold = list(range(10_000, 13_125))
    core.routed("cold", 0, cold, core.decide(cold, {}, 0.0, rng, workers=[0]).decision.chosen,
                0.0, None, len(cold) * 32)
    short = list(range(20_000, 20_010))
    core.routed("short", 1, short,
                core.decide(short, {}, 0.0, rng, workers=[1]).decision.chosen, 0.0, None, 321)
    shared = list(range(1, 1_251))
    prompt = shared + list(range(30_000, 30_020))

    def question(now: float) -> int:
        routed = core.decide(prompt, {0: (1_250, 1_250)}, now, rng, tokens=len(prompt) * 32)
        return routed.decision.worker

    assert core.wait(0) > 2.0
    assert question(0.5) == 1
    host = Stored(list(range(2_900)), None, [0] * 2_900 * 32, 32, medium="cpu")
    core.events_applied(0, [host], 0.6)  # copies to the host tier are no progress
    assert question(0.6) == 1
    stored = Stored(list(range(2_900)), None, [0] * 2_900 * 32, 32)
    core.events_applied(0, [stored], 2.2)
    assert core.wait(0) < 0.4
    assert question(2.2) == 0


def test_a_busy_fleets_recompute_is_priced_for_the_requests_queued_behind_it() -> None:
    # Worker 0 holds a 40k-token prefix behind a 100k-token cold prompt (about 2.5 s);
    # worker 1 prefills a short prompt. A question on the prefix recomputes it on worker 1
    # while one request prefills per worker (its prefill priced as passed on to two later
    # requests), and stays with the holder once five do (six later requests): a recompute
    # then delays more requests than the holder's queue delays this one.
    core = RoutingCore(CoreSettings())
    for w in (0, 1):
        core.worker_joined(w)
    rng = random.Random(5)

    def book(name: str, worker: int, hashes: list[int]) -> None:
        chosen = core.decide(hashes, {}, 0.0, rng, workers=[worker]).decision.chosen
        core.routed(name, worker, hashes, chosen, 0.0, None, len(hashes) * 32)

    book("cold", 0, list(range(10_000, 13_125)))
    book("short", 1, list(range(20_000, 20_010)))
    prompt = list(range(1, 1_251)) + list(range(30_000, 30_020))

    def question() -> tuple[int, dict[int, WorkerCost]]:
        decision = core.decide(prompt, {0: (1_250, 1_250)}, 0.1, rng,
                               tokens=len(prompt) * 32).decision
        return decision.worker, {c.worker: c for c in decision.costs}

    assert core.passed_on() == 2.0
    worker, costs = question()
    assert worker == 1
    for c in costs.values():  # every worker has a request prefilling: n = 2
        assert c.price == c.cost + 2.0 * c.prefill_s
    for i in range(4):  # one-block prompts: the queues' counts grow, their waits barely
        for w in (0, 1):
            book(f"tiny{w}-{i}", w, [40_000 + 10 * w + i])
    assert core.passed_on() == 6.0
    worker, costs = question()
    assert worker == 0
    assert costs[0].wait_s - costs[1].wait_s > 2.0, "the holder's queue is still the longer"
    # A worker with nothing prefilling (here: only decoding) passes its prefill to one.
    for w in (0, 1):
        for name in ([f"tiny{w}-{i}" for i in range(4)] + ["cold" if w == 0 else "short"]):
            core.first_token(name, 0.2)
    book("again", 0, list(range(50_000, 50_100)))
    assert core.passed_on() == 1.5
    _, costs = question()
    assert costs[1].wait_s > 0, "worker 1 decodes: the fleet is busy"
    assert costs[1].price == costs[1].cost + costs[1].prefill_s
    assert costs[0].price == costs[0].cost + 1.5 * costs[0].prefill_s


def test_dynamos_rule_queues_a_prefill_whole_until_its_first_token() -> None:
    core = RoutingCore(CoreSettings(policy="dynamo"))
    core.worker_joined(0)
    cold = list(range(10_000, 13_125))
    chosen = core.decide(cold, {}, 0.0, random.Random(0), workers=[0]).decision.chosen
    core.routed("cold", 0, cold, chosen, 0.0, None, len(cold) * 32)
    before = core.wait(0)
    core.events_applied(0, [Stored(list(range(2_900)), None, [0] * 2_900 * 32, 32)], 1.0)
    assert core.wait(0) == before > 0


def test_a_prediction_settles_on_the_index_after_its_first_token() -> None:
    # Worker 0 publishes events, worker 1 does not (approximate). A prompt routed to each is
    # predicted resident for --predict-ttl (10 s). Its first token says the prompt is stored;
    # the event-fed worker's next events bring the index up to date, and its prediction ends
    # (the index knows from then on, evictions included); the approximate worker's lives on.
    core = RoutingCore(CoreSettings())
    core.worker_joined(0)
    core.worker_joined(1, approximate=True)
    rng = random.Random(0)
    prompts = {0: list(range(1, 9)), 1: list(range(101, 109))}
    for w, prompt in prompts.items():
        core.routed(f"r{w}", w, prompt, _terms(core, w), 0.0, None, 8 * 32 + 1)

    def held(worker: int, now: float) -> int:
        decision = core.decide(prompts[worker], {}, now, rng, tokens=8 * 32 + 1).decision
        return decision.terms(worker).matched_blocks

    core.events_applied(0, [], 0.2)  # events before the first token end nothing
    assert (held(0, 0.3), held(1, 0.3)) == (8, 8)
    for w in prompts:
        core.first_token(f"r{w}", 0.5)
    assert (held(0, 5.0), held(1, 5.0)) == (8, 8)  # no events from worker 0 yet
    core.events_applied(0, [], 5.0)
    core.events_applied(1, [], 5.0)
    assert (held(0, 5.1), held(1, 5.1)) == (0, 8)


def test_a_booking_with_a_prediction_of_its_own_reports_it_and_teaches_no_rate() -> None:
    # Each first token comes 10x later than the worker's own price says. Booked with its
    # terms, the worker's factor learns it; booked with a prediction spanning other workers'
    # work (a remote prefill's), the prediction is what the first token reports, and the
    # factor stays where it was.
    factors = []
    for own in (False, True):
        core = RoutingCore(CoreSettings())
        core.worker_joined(0)
        rng = random.Random(1)
        now = 0.0
        for i in range(40):
            hashes = [1000 * i + b for b in range(20)]
            terms = core.decide(hashes, {}, now, rng).decision.chosen
            predicted = terms.cost * 3 if own else None
            core.routed(f"r{i}", 0, hashes, terms, now, predicted_s=predicted)
            told = core.first_token(f"r{i}", now + 10 * terms.cost)
            assert told is not None
            assert told.predicted_s == (terms.cost * 3 if own else terms.cost)
            core.finished(f"r{i}")
            now += 100.0
        factors.append(core.rate_factor(0))
    assert factors[0] > 2 and factors[1] == 1.0


def _stored(first: int, blocks: int) -> Stored:
    return Stored(block_hashes=list(range(first, first + blocks)), parent_block_hash=None,
                  token_ids=[7] * (blocks * 32), block_size=32)


def _terms_on(core: RoutingCore, worker: int, hashes: list[int]) -> WorkerCost:
    """The terms of recomputing ``hashes`` on ``worker`` (it holds none of them)."""
    return core.decide(hashes, {}, 0.0, random.Random(0), workers=[worker],
                       fetch=False).decision.chosen


def _done(core: RoutingCore, worker: int, blocks: int, matched: int) -> float:
    """Seconds of a prefill done once ``blocks`` of it after ``matched`` held are stored."""
    r = core.rates(worker)
    return r.prefill_s * blocks + r.context_s * blocks * (matched + 0.5 * blocks)


def _fetch_pair() -> RoutingCore:
    """Worker 0 holds blocks behind a long foreign queue; worker 1, idle, fetches them."""
    core = RoutingCore(CoreSettings())
    for w in range(2):
        core.worker_joined(w, fetch=FetchAbility(True, True, 32768))
    core.load_reported(0, ReportedLoad(running=1, pending_prefill_blocks=50000.0))
    return core


def test_blocks_a_fetch_stores_are_not_its_workers_prefill_progress() -> None:
    """A worker told to fetch 900 blocks stores them before it prefills anything: its
    events' stores are taken off the fetch's blocks first, so the head's booked prefill
    stays; once the fetch's blocks are in, further stores are the prefill's progress. A
    failed fetch is booked as the recompute it is, and its blocks are that prefill's."""
    core = _fetch_pair()
    hashes = list(range(1, 1001))
    routed = core.decide(hashes, {0: (900, 900)}, 0.0, random.Random(0))
    terms = routed.decision.chosen
    assert (routed.decision.worker, terms.fetch_source, terms.fetch_blocks) == (1, 0, 900)
    core.routed("r", 1, hashes, terms, 0.0)
    booked = core.wait(1)
    core.fetch_answered("r", 900)
    core.events_applied(1, [_stored(0, 900)], 0.1)
    assert core.wait(1) == booked  # the fetch's blocks: no prefill done
    core.events_applied(1, [_stored(900, 50)], 0.2)
    assert core.wait(1) < booked  # the prefill's own blocks
    # A second fetch that fails: it prefills the 1000 blocks, and its stores are progress.
    core.finished("r")
    other = list(range(5001, 6001))
    routed = core.decide(other, {0: (900, 900)}, 1.0, random.Random(0))
    fetch = routed.decision.chosen
    assert (routed.decision.worker, fetch.fetch_source) == (1, 0)
    core.routed("s", 1, other, fetch, 1.0)
    assert core.wait(1) == pytest.approx(fetch.prefill_s)
    core.fetch_answered("s", None)
    assert core.wait(1) == pytest.approx(fetch.recompute_cost - fetch.wait_s
                                         - core.rates(1).first_s)
    before = core.wait(1)
    core.events_applied(1, [_stored(2000, 100)], 1.1)
    assert core.wait(1) < before


def test_a_fetch_in_flight_is_not_its_workers_head() -> None:
    """The trace's tail at x4.4: a request fetching 1,696 blocks is sent to worker 1, then
    a 1,130-block prompt the worker prefills while the fetch is on the wire; the fetch's
    request runs after it. Its stores are its own prefill's progress, not the fetching
    request's, and once both have answered nothing stored is left over for the next: a
    66k-token prompt queued behind them is priced whole. (Counted as the fetching
    request's, the 1,130 blocks and the 408 the fetch's count had taken from earlier
    prefills were carried from head to head, and a 191k-token prompt's worker was priced
    3.5 s short.)"""
    core = _fetch_pair()
    held = list(range(1, 1708))
    routed = core.decide(held, {0: (1696, 1696)}, 0.0, random.Random(0))
    fetch = routed.decision.chosen
    assert (routed.decision.worker, fetch.fetch_source, fetch.fetch_blocks) == (1, 0, 1696)
    core.routed("fetching", 1, held, fetch, 0.0)
    cold = list(range(10_000, 11_130))
    core.routed("cold", 1, cold, _terms_on(core, 1, cold), 0.0)
    booked = core.wait(1)
    core.events_applied(1, [_stored(10_000, 255)], 0.05)  # cold's first chunk
    assert core.wait(1) < booked
    core.fetch_answered("fetching", 1696)  # it joins the queue behind cold
    core.events_applied(1, [_stored(0, 1696), _stored(10_255, 256)], 0.1)
    for i in range(2):
        core.events_applied(1, [_stored(10_511 + 256 * i, 256)], 0.2 + 0.1 * i)
    assert core.wait(1) == pytest.approx(booked - _done(core, 1, 1023, 0), rel=1e-6)
    core.events_applied(1, [_stored(11_023, 107), _stored(1696, 11)], 0.4)
    later = list(range(20_000, 22_076))
    alone = _terms_on(core, 1, later).prefill_s
    core.routed("later", 1, later, _terms_on(core, 1, later), 0.4)
    core.first_token("cold", 0.4)
    core.first_token("fetching", 0.4)
    decoding = core.rates(1).decode_s * (len(cold) + len(held))
    assert core.wait(1) == pytest.approx(alone + decoding)


def test_a_fetch_books_its_read_on_the_source_until_the_first_token() -> None:
    """The source copies the blocks out beside its passes: the read's seconds are queued
    work there from the routing of the fetch to its request's first token (or its end)."""
    core = RoutingCore(CoreSettings())
    for w in range(2):
        core.worker_joined(w, fetch=FetchAbility(True, True, 32768))
    core.load_reported(0, ReportedLoad(running=1, pending_prefill_blocks=50000.0))
    hashes = list(range(1, 1001))
    queued = core.wait(0)
    routed = core.decide(hashes, {0: (900, 900)}, 0.0, random.Random(0))
    terms = routed.decision.chosen
    assert (routed.decision.worker, terms.fetch_source) == (1, 0) and terms.fetch_s > 0
    core.routed("r", 1, hashes, terms, 0.0)
    assert core.wait(0) == pytest.approx(queued + terms.fetch_s)
    core.first_token("r", 0.5)
    assert core.wait(0) == pytest.approx(queued)
    core.finished("r")  # idempotent: the read is released once
    assert core.wait(0) == pytest.approx(queued)
