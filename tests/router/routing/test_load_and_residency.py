"""Load accounting through a request's life, reported-load correction, predicted residency."""

from __future__ import annotations

import random

import pytest

from router.routing.load import LoadTracker, ReportedLoad, WorkerLoad
from router.routing.residency import PredictedResidency


def test_a_request_moves_from_prefill_to_decode_to_gone() -> None:
    t = LoadTracker()
    t.add_worker(0)
    t.routed("a", 0, prefill_blocks=6, decode_blocks=10)
    assert t.load(0) == WorkerLoad(1, 6.0, 0.0, prefilling=1)
    assert t.prefilling() == 1
    t.first_token("a")
    assert t.load(0) == WorkerLoad(1, 0.0, 10.0)
    t.first_token("a")  # a second first token changes nothing
    t.finished("a")
    assert t.load(0) == WorkerLoad(0, 0.0, 0.0)
    t.finished("a")  # nor does a second finish
    assert t.prefilling() == 0


def test_a_request_failing_before_its_first_token_releases_its_prefill() -> None:
    t = LoadTracker()
    t.add_worker(0)
    t.routed("a", 0, 4, 8)
    t.finished("a")
    assert t.load(0) == WorkerLoad(0, 0.0, 0.0)


def test_reported_load_adds_what_other_routers_sent() -> None:
    t = LoadTracker()
    t.add_worker(0)
    t.routed("a", 0, 4, 8, prefill_s=0.5)
    # the worker sees 3 requests: ours plus two from elsewhere, 10 pending prefill blocks
    # (6 foreign: priced at the worker's rates, ours at the seconds booked)
    t.reported(0, ReportedLoad(running=1, waiting=2, pending_prefill_blocks=10,
                               decode_blocks=0))
    assert t.load(0) == WorkerLoad(3, 10.0, 0.0, pending_prefill_s=0.5,
                                   external_prefill_blocks=6.0, prefilling=1)
    # a report below our own books never lowers them
    t.reported(0, ReportedLoad())
    assert t.load(0) == WorkerLoad(1, 4.0, 0.0, pending_prefill_s=0.5, prefilling=1)


def test_figures_are_the_load_as_a_tuple() -> None:
    rng = random.Random(3)
    t = LoadTracker()
    for w in range(3):
        t.add_worker(w)
    live: list[str] = []
    for i in range(500):
        roll = rng.random()
        if roll < 0.4 or not live:
            live.append(f"r{i}")
            t.routed(live[-1], rng.randrange(3), rng.randrange(9), rng.randrange(1, 9),
                     rng.random(), lin=rng.random() / 8, quad=rng.random() / 64)
        elif roll < 0.6:
            t.first_token(rng.choice(live))
        elif roll < 0.8:
            t.finished(live.pop(rng.randrange(len(live))))
        elif roll < 0.9:
            t.stored(rng.randrange(4), rng.randrange(1, 12))
        else:
            t.reported(rng.randrange(3), ReportedLoad(
                running=rng.randrange(5), waiting=rng.randrange(3),
                pending_prefill_blocks=rng.randrange(20), decode_blocks=rng.randrange(20)))
        for w in range(4):  # 3: an unknown worker
            load = t.load(w)
            assert t.figures(w) == (load.active_requests, load.pending_prefill_blocks,
                                    load.decode_blocks, load.pending_prefill_s,
                                    load.external_prefill_blocks, load.prefilling)
        assert t.prefilling() == sum(t.load(w).prefilling for w in range(3))


def test_the_head_prefills_as_its_blocks_are_stored() -> None:
    t = LoadTracker()
    t.add_worker(0)
    # a: 100 blocks, 0.01 s each plus 0.0001 s x blocks done (attention grows), 2.0 s in all
    t.routed("a", 0, 100, 120, prefill_s=2.0, lin=0.01, quad=0.0001)
    t.routed("b", 0, 10, 20, prefill_s=0.5, lin=0.05)
    assert t.load(0).pending_prefill_s == pytest.approx(2.5)
    t.stored(0, 40)  # a's first chunks: 0.4 + 0.16 s of it done
    assert t.load(0).pending_prefill_s == pytest.approx(2.5 - 0.56)
    t.stored(0, 64)  # past a's blocks: a is done, b still waits whole
    assert t.load(0).pending_prefill_s == pytest.approx(0.5)
    t.first_token("a")  # b is the head now, with the 4 blocks stored past a's
    assert t.load(0).pending_prefill_s == pytest.approx(0.3)
    t.stored(0, 3)
    assert t.load(0).pending_prefill_s == pytest.approx(0.15)
    t.finished("b")
    assert t.load(0).pending_prefill_s == pytest.approx(0.0)


def test_a_head_that_ends_before_its_blocks_are_stored_leaves_nothing_over() -> None:
    t = LoadTracker()
    t.add_worker(0)
    t.routed("a", 0, 100, 120, prefill_s=1.0, lin=0.01)
    t.routed("b", 0, 10, 20, prefill_s=0.5, lin=0.05)
    t.stored(0, 30)
    t.first_token("a")  # its last 70 blocks' events still to come: b starts from nothing
    assert t.load(0).pending_prefill_s == pytest.approx(0.5)
    t.routed("c", 0, 10, 20, prefill_s=0.5, lin=0.05)
    t.finished("c")  # not the head: b's count is untouched
    t.stored(0, 2)
    assert t.load(0).pending_prefill_s == pytest.approx(0.4)


def test_a_fetching_request_joins_the_queue_when_its_fetch_is_over() -> None:
    t = LoadTracker()
    t.add_worker(0)
    # f fetches its prefix first; b, sent after it, is what the worker prefills meanwhile.
    t.routed("f", 0, 2, 8, prefill_s=0.2, lin=0.1, fetching=True)
    t.routed("b", 0, 10, 20, prefill_s=1.0, lin=0.1)
    assert t.load(0).pending_prefill_s == pytest.approx(1.2)  # both booked
    assert t.load(0).prefilling == 2
    t.stored(0, 4)  # b's first blocks: b is the head, f is not queued
    assert t.load(0).pending_prefill_s == pytest.approx(0.8)
    assert t.queued("f") == 0 and t.queued("f") is None  # behind b now; once
    t.stored(0, 8)  # b done, 2 past it
    assert t.load(0).pending_prefill_s == pytest.approx(0.2)
    t.first_token("b")  # f is the head, with the 2 blocks stored past b's
    assert t.load(0).pending_prefill_s == pytest.approx(0.0)
    t.first_token("f")
    assert t.load(0).prefilling == 0 and t.prefilling() == 0


def test_a_failed_fetch_is_booked_as_the_prefill_it_now_is() -> None:
    t = LoadTracker()
    t.add_worker(0)
    t.routed("f", 0, 2, 8, prefill_s=0.2, lin=0.1, fetching=True)
    t.queued("f", (12.0, 1.5, 0.125))  # it computes the 10 blocks it was to fetch too
    load = t.load(0)
    assert (load.pending_prefill_blocks, load.pending_prefill_s) == (12.0, pytest.approx(1.5))
    t.stored(0, 4)
    assert t.load(0).pending_prefill_s == pytest.approx(1.0)
    t.finished("f")
    assert t.load(0) == WorkerLoad(0, 0.0, 0.0)


def test_blocks_stored_with_nothing_prefilling_are_not_banked() -> None:
    t = LoadTracker()
    t.add_worker(0)
    t.routed("a", 0, 4, 8, prefill_s=0.4, lin=0.1)
    t.first_token("a")
    t.stored(0, 50)  # decode steps filling blocks, not a prefill's progress
    t.routed("b", 0, 4, 8, prefill_s=0.4, lin=0.1)
    assert t.load(0).pending_prefill_s == pytest.approx(0.4)
    t.stored(3, 5)  # an unknown worker: ignored
    t.routed("c", 0, 4, 8, prefill_s=0.4, lin=0.1)
    t.finished("b")  # the head gone before its first token: c starts from nothing
    assert t.load(0).pending_prefill_s == pytest.approx(0.4)


def test_our_own_request_in_another_phase_is_not_foreign_load() -> None:
    t = LoadTracker()
    t.add_worker(0)
    t.routed("a", 0, 4, 8)  # non-streamed: our books keep it in prefill until it ends
    t.reported(0, ReportedLoad(running=1, pending_prefill_blocks=0, decode_blocks=8))
    assert t.load(0) == WorkerLoad(1, 4.0, 0.0, prefilling=1)
    t.finished("a")
    assert t.load(0) == WorkerLoad(0, 0.0, 0.0), "no stale load after it ends"


def test_removing_a_worker_returns_its_in_flight_requests() -> None:
    t = LoadTracker()
    t.add_worker(0)
    t.routed("b", 0, 1, 1)
    t.routed("a", 0, 1, 1)
    t.add_worker(1)
    t.routed("c", 1, 1, 1)
    assert t.prefilling() == 3
    assert t.remove_worker(0) == ["a", "b"]
    t.finished("a")  # a late finish for a removed worker is harmless
    assert t.load(0) == WorkerLoad(0, 0.0, 0.0)
    assert t.prefilling() == 1, "the removed worker's requests no longer count"


def test_routing_twice_or_to_an_unknown_worker_is_refused() -> None:
    t = LoadTracker()
    t.add_worker(0)
    t.routed("a", 0, 1, 1)
    with pytest.raises(ValueError, match="already in flight"):
        t.routed("a", 0, 1, 1)
    with pytest.raises(ValueError, match="not tracked"):
        t.routed("b", 7, 1, 1)


def test_predictions_extend_a_run_until_they_expire(
        residency: type[PredictedResidency]) -> None:
    p = residency(ttl=2.0)
    p.predict(1, [10, 11, 12], now=100.0)
    assert p.extend(1, [10, 11, 12, 13], start=0, now=101.0) == 3
    assert p.extend(1, [10, 11, 99, 12], start=0, now=101.0) == 2  # a run, not a set
    assert p.extend(1, [10, 11, 12], start=1, now=101.0) == 3
    assert p.extend(2, [10, 11, 12], start=0, now=101.0) == 0  # another worker
    assert p.extend(1, [10, 11, 12], start=0, now=102.0) == 0  # expired
    assert p.expire(now=102.0) == 3 and p.size(1) == 0


def test_predictions_are_bounded_oldest_first_and_forgettable(
        residency: type[PredictedResidency]) -> None:
    p = residency(ttl=60.0, max_blocks=3)
    p.predict(0, [1, 2, 3], now=0.0)
    p.predict(0, [4], now=1.0)
    assert p.extend(0, [1], 0, now=2.0) == 0  # 1 was the oldest
    assert p.extend(0, [2, 3, 4], 0, now=2.0) == 3
    p.forget(0)
    assert p.workers() == []


def test_expiry_drops_only_the_expired_front_and_empty_workers(
        residency: type[PredictedResidency]) -> None:
    p = residency(ttl=10.0)
    p.predict(0, [1, 2], now=0.0)
    p.predict(0, [3], now=5.0)
    p.predict(0, [1], now=6.0)  # 1 again: lives to 16, behind 3
    p.predict(1, [9], now=1.0)
    assert p.expire(now=10.0) == 1  # 2 went; 3 (15) and 1 (16) stay
    assert p.extend(0, [3], 0, now=10.0) == 1 and p.extend(0, [1], 0, now=10.0) == 1
    assert p.size(0) == 2 and p.workers() == [0, 1]
    assert p.expire(now=16.0) == 3
    assert p.workers() == [] and p.size(0) == p.size(1) == 0


def test_withdrawn_predictions_are_gone(
        residency: type[PredictedResidency]) -> None:
    p = residency(ttl=10.0)
    p.predict(0, [1, 2, 3], now=0.0)
    p.withdraw(0, [2, 3, 4])
    p.withdraw(5, [1])  # a worker with nothing predicted
    assert p.extend(0, [1, 2], 0, now=1.0) == 1 and p.size(0) == 1


def test_runs_and_expiry_agree_with_a_walk_over_every_prediction(
        compiled_residency: type[PredictedResidency]) -> None:
    """Random predictions, withdrawals, settling, forgetting and expiry: each run from a start
    is the leading walk over unexpired predictions; the compiled twin, fed the same calls,
    answers every one the same."""
    rng = random.Random(9)
    p = PredictedResidency(ttl=3.0, max_blocks=40)
    twin = compiled_residency(ttl=3.0, max_blocks=40)
    chains = [[rng.getrandbits(62) for _ in range(12)] for _ in range(6)]
    now = 0.0
    for _ in range(1500):
        now += rng.choice([0.0, 0.1, 0.7])
        worker, chain = rng.randrange(5), rng.choice(chains)
        action = rng.random()
        if action < 0.55:
            cut = chain[: rng.randrange(1, 13)]
            p.predict(worker, cut, now)
            twin.predict(worker, cut, now)
        elif action < 0.65:
            cut = chain[: rng.randrange(1, 13)]
            p.withdraw(worker, cut)
            twin.withdraw(worker, cut)
        elif action < 0.7:
            p.forget(worker)
            twin.forget(worker)
        elif action < 0.75:
            until = now + rng.choice([-1.0, 0.5, 5.0])
            p.settle(worker, chain, until)
            twin.settle(worker, chain, until)
        elif action < 0.9:
            assert twin.expire(now) == p.expire(now)
        hashes = rng.choice(chains)
        start = rng.randrange(0, 13)
        entries = p._by_worker.get(worker, {})
        n = start
        while n < len(hashes) and entries.get(hashes[n], 0.0) > now:
            n += 1
        assert p.extend(worker, hashes, start, now) == twin.extend(worker, hashes, start, now) == n
        assert twin.holders(hashes[0], now) == p.holders(hashes[0], now)
        assert twin.workers() == p.workers()
        assert [twin.size(w) for w in range(5)] == [p.size(w) for w in range(5)]


def test_holders_are_the_workers_a_first_block_is_live_on(
        residency: type[PredictedResidency]) -> None:
    p = residency(ttl=10.0)
    p.predict(0, [1, 2], now=0.0)
    p.predict(1, [1, 3], now=5.0)
    p.predict(2, [7, 1], now=5.0)  # 1 is not its first block: listed only under 7
    assert sorted(p.holders(1, now=9.0)) == [0, 1] and p.holders(7, now=9.0) == [2]
    assert p.holders(1, now=12.0) == [1]  # worker 0's prediction expired
    p.settle(1, [1], until=11.0)  # its first token came: the events take over by then
    assert p.holders(1, now=12.0) == [] and p.extend(1, [1, 3], 0, now=11.5) == 0
    assert p.extend(1, [3], 0, now=11.5) == 1  # a block not settled keeps its expiry
    assert p.holders(2, now=0.0) == [] and p.holders(99, now=0.0) == []


def test_a_block_hash_outside_64_bits_is_refused_or_simply_absent(
        residency: type[PredictedResidency]) -> None:
    """The compiled twin holds 64-bit hashes, as the index does: such a prediction is refused
    there, and asking about such a hash finds nothing in either."""
    p = residency(ttl=10.0)
    p.predict(0, [5], now=0.0)
    assert p.extend(0, [5, -1, 6], 0, now=1.0) == 1
    assert p.extend(0, [5, 1 << 64], 0, now=1.0) == 1
    p.withdraw(0, [-1, 1 << 64])
    assert p.holders(-1, now=1.0) == [] and p.size(0) == 1
    if residency is not PredictedResidency:
        with pytest.raises(ValueError, match="2\\*\\*64"):
            p.predict(0, [6, -1], now=0.0)
        assert p.size(0) == 1  # nothing recorded
