"""Flow control's rules with injected time: saturation, priority bands, fair shares of tokens
between tenants, deadlines, a full queue, expiry."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.routing.admission import (
    OTHER_TENANTS,
    FlowQueue,
    FlowSettings,
    Waiting,
    fleet_saturated,
    has_room,
    priority_label,
    retry_after,
    worker_saturated,
)

BOUNDS = FlowSettings(ttft_bound_s=1.0, kv_threshold=0.9, max_queue=100, max_wait_s=30.0)
NO_KV = FlowSettings(ttft_bound_s=1.0)


def item(key: str, priority: int = 0, tenant: str = "a", tokens: int = 100, arrived: float = 0.0,
         deadline: float | None = None) -> Waiting:
    return Waiting(key, priority, tenant, tokens, arrived, deadline)


def drain(queue: FlowQueue) -> list[str]:
    out = []
    while (w := queue.pop()) is not None:
        out.append(w.key)
    return out


def test_a_worker_is_saturated_by_its_predicted_ttft_or_its_kv_usage() -> None:
    assert not worker_saturated(1.0, 0.9, BOUNDS)  # at the bounds: not over them
    assert worker_saturated(1.01, 0.0, BOUNDS)
    assert worker_saturated(0.1, 0.91, BOUNDS)
    assert not worker_saturated(0.1, 5.0, NO_KV)  # threshold 0: KV usage not checked


def test_the_fleet_is_saturated_only_when_every_candidate_is() -> None:
    assert fleet_saturated([(2.0, 0.0), (0.1, 0.95)], BOUNDS)
    assert not fleet_saturated([(2.0, 0.0), (0.5, 0.5)], BOUNDS)
    assert not fleet_saturated([], BOUNDS)  # nothing healthy is a 503, not a wait


def test_the_most_urgent_band_leaves_first_and_arrival_order_holds_inside_a_tenant() -> None:
    q = FlowQueue(BOUNDS)
    for key, prio in [("low1", 5), ("hi1", -1), ("mid", 0), ("low2", 5), ("hi2", -1)]:
        assert q.offer(item(key, prio), 0.0, 2.0, 0.0).refused is None
    assert q.lengths() == {-1: 2, 0: 1, 5: 2}
    assert drain(q) == ["hi1", "hi2", "mid", "low1", "low2"]
    assert len(q) == 0 and q.lengths() == {}


def test_two_equal_tenants_share_tokens_evenly_whatever_each_sends() -> None:
    # Tenant a queues 50 requests of 100 tokens, tenant b 5 of them: while both wait, they
    # leave alternately, so b is not starved behind a's burst.
    q = FlowQueue(BOUNDS)
    for i in range(50):
        q.offer(item(f"a{i}", tenant="a"), 0.0, 2.0, 0.0)
    for i in range(5):
        q.offer(item(f"b{i}", tenant="b"), 0.0, 2.0, 0.0)
    first_ten = drain(q)[:10]
    assert Counter(k[0] for k in first_ten) == {"a": 5, "b": 5}


def test_fairness_counts_tokens_not_requests() -> None:
    # a sends prompts of 1,000 tokens, b of 100: in the first 11,000 tokens served each
    # tenant gets about half of them, b in ten times as many requests.
    q = FlowQueue(BOUNDS)
    for i in range(20):
        q.offer(item(f"a{i}", tenant="a", tokens=1000), 0.0, 2.0, 0.0)
    for i in range(200):
        q.offer(item(f"b{i}", tenant="b", tokens=100), 0.0, 2.0, 0.0)
    served: Counter[str] = Counter()
    while sum(served.values()) < 10_000:
        w = q.pop()
        assert w is not None
        served[w.tenant] += w.tokens
    assert abs(served["a"] - served["b"]) <= 1000


def test_weights_split_the_tokens_in_proportion() -> None:
    q = FlowQueue(FlowSettings(max_queue=1000, weights={"gold": 3.0}))
    for i in range(100):
        q.offer(item(f"g{i}", tenant="gold"), 0.0, 2.0, 0.0)
        q.offer(item(f"s{i}", tenant="std"), 0.0, 2.0, 0.0)
    first = drain(q)[:40]
    assert Counter(k[0] for k in first) == {"g": 30, "s": 10}


def test_a_tenant_back_from_idle_starts_even_not_with_credit() -> None:
    # b was idle while a was served: b does not get a's 10 served requests back as a burst.
    q = FlowQueue(BOUNDS)
    for i in range(20):
        q.offer(item(f"a{i}", tenant="a"), 0.0, 2.0, 0.0)
    assert drain(q)[:10] == [f"a{i}" for i in range(10)]
    q2 = FlowQueue(BOUNDS)
    for i in range(20):
        q2.offer(item(f"a{i}", tenant="a"), 0.0, 2.0, 0.0)
    for _ in range(10):
        q2.pop()
    for i in range(5):
        q2.offer(item(f"b{i}", tenant="b"), 0.0, 2.0, 0.0)
    nxt = [q2.pop().key for _ in range(4)]  # type: ignore[union-attr]
    assert Counter(k[0] for k in nxt) == {"a": 2, "b": 2}


def test_an_unmeetable_deadline_is_refused_on_arrival_with_a_retry_after() -> None:
    q = FlowQueue(BOUNDS)
    # The same tenant's 1,000 tokens queued ahead at 1 ms each: 1 s of queue, plus 2 s of
    # TTFT, past a deadline 2.5 s away.
    q.offer(item("ahead", tokens=1000), 0.0, 2.0, 1e-3)
    offer = q.offer(item("late", deadline=2.5), 0.0, 2.0, 1e-3)
    assert offer.refused is not None and offer.refused.reason == "deadline"
    assert offer.refused.retry_after_s == 3
    assert "late" not in q
    # Another tenant's short request leaves before that long one (fair shares): admitted.
    assert q.offer(item("other", tenant="b", deadline=2.5), 0.0, 2.0, 1e-3).refused is None
    # The same deadline in a more urgent band has nothing ahead of it: admitted.
    assert q.offer(item("urgent", priority=-1, deadline=2.5), 0.0, 2.0, 1e-3).refused is None


def test_a_full_queue_sheds_its_least_urgent_request_for_a_more_urgent_one() -> None:
    q = FlowQueue(FlowSettings(max_queue=3))
    q.offer(item("p0", 0), 0.0, 2.0, 0.0)
    q.offer(item("p5a", 5), 0.0, 2.0, 0.0)
    q.offer(item("p5b", 5), 0.0, 2.0, 0.0)
    # Equal or less urgent than the least urgent queued: refused, nothing displaced.
    full = q.offer(item("p5c", 5), 0.0, 2.0, 0.0)
    assert full.refused is not None and full.refused.reason == "queue_full"
    # More urgent: the lowest band's last-to-leave request is displaced.
    offer = q.offer(item("p1", 1), 0.0, 2.0, 0.0)
    assert offer.refused is None
    assert [(s.key, s.reason) for s in offer.displaced] == [("p5b", "displaced")]
    assert drain(q) == ["p0", "p1", "p5a"]


def test_a_zero_length_queue_refuses_every_wait() -> None:
    q = FlowQueue(FlowSettings(max_queue=0))
    offer = q.offer(item("x"), 0.0, 2.0, 0.0)
    assert offer.refused is not None and offer.refused.reason == "queue_full"


def test_waiting_requests_expire_by_wait_and_by_deadline() -> None:
    q = FlowQueue(BOUNDS)
    q.offer(item("old", arrived=0.0), 0.0, 0.5, 0.0)
    q.offer(item("due", tenant="b", arrived=5.0, deadline=10.0), 5.0, 0.5, 0.0)
    q.offer(item("fine", tenant="c", arrived=5.0, deadline=40.0), 5.0, 0.5, 0.0)
    assert q.expire(9.0, 0.5) == []
    # At 9.6 a first token 0.5 s away misses the deadline of 10: shed before it is due.
    assert [(s.key, s.reason) for s in q.expire(9.6, 0.5)] == [("due", "deadline")]
    assert [(s.key, s.reason) for s in q.expire(30.0, 0.5)] == [("old", "timeout")]
    assert drain(q) == ["fine"]


def test_offering_a_queued_key_again_is_a_caller_error() -> None:
    q = FlowQueue(BOUNDS)
    q.offer(item("x"), 0.0, 2.0, 0.0)
    with pytest.raises(ValueError, match="already queued"):
        q.offer(item("x"), 0.0, 2.0, 0.0)


@pytest.mark.parametrize("bad", [{"ttft_bound_s": 0.0}, {"kv_threshold": float("nan")},
                                 {"kv_threshold": -0.5}, {"max_queue": -1},
                                 {"weights": {"t": 0.0}},
                                 {"deadlines": {0: -1.0}}])
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        FlowSettings(**bad)  # type: ignore[arg-type]


def test_labels_and_retry_after_are_bounded() -> None:
    assert [priority_label(p) for p in (-11, -10, 0, 10, 11, 10**9)] == [
        "high", "-10", "0", "10", "low", "low"]
    assert retry_after(0.0) == 1 and retry_after(2.1) == 3 and retry_after(float("inf")) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 2), st.sampled_from("abc"), st.integers(1, 500)),
                min_size=1, max_size=60),
       st.integers(1, 30))
def test_pop_order_is_by_band_then_finish_and_nothing_is_lost(
        arrivals: list[tuple[int, str, int]], max_queue: int) -> None:
    q = FlowQueue(FlowSettings(max_queue=max_queue))
    admitted: set[str] = set()
    for i, (prio, tenant, tokens) in enumerate(arrivals):
        offer = q.offer(item(f"r{i}", prio, tenant, tokens), 0.0, 2.0, 0.0)
        for s in offer.displaced:
            admitted.discard(s.key)
        if offer.refused is None:
            admitted.add(f"r{i}")
        assert len(q) <= max_queue
    assert sum(q.lengths().values()) == len(q) == len(admitted)
    out = []
    while (w := q.pop()) is not None:
        out.append(w)
    assert {w.key for w in out} == admitted
    # Bands leave in order of urgency; inside one, a tenant's requests keep arrival order.
    assert [w.priority for w in out] == sorted(w.priority for w in out)
    for prio in {w.priority for w in out}:
        for tenant in "abc":
            seqs = [w.seq for w in out if w.priority == prio and w.tenant == tenant]
            assert seqs == sorted(seqs)


def test_tenant_labels_are_the_weights_names_and_other() -> None:
    flow = FlowSettings(weights={"gold": 3.0, "salt:0a1b2c3d4e5f": 1.0})
    assert [flow.tenant_label(t) for t in ("gold", "salt:0a1b2c3d4e5f", "anyone", "")] == [
        "gold", "salt:0a1b2c3d4e5f", OTHER_TENANTS, OTHER_TENANTS]


def test_counts_and_refusals_name_the_priority_and_tenant() -> None:
    q = FlowQueue(FlowSettings(max_queue=3))
    q.offer(item("a1", 0, "a"), 0.0, 2.0, 0.0)
    q.offer(item("a2", 0, "a"), 0.0, 2.0, 0.0)
    q.offer(item("b1", 5, "b"), 0.0, 2.0, 0.0)
    assert q.counts() == {(0, "a"): 2, (5, "b"): 1}
    offer = q.offer(item("c1", 1, "c"), 0.0, 2.0, 0.0)  # displaces b's
    assert [(s.key, s.priority, s.tenant) for s in offer.displaced] == [("b1", 5, "b")]
    full = q.offer(item("c2", 1, "c"), 0.0, 2.0, 0.0)
    assert full.refused is not None
    assert (full.refused.priority, full.refused.tenant) == (1, "c")
    late = q.offer(item("d1", 0, "d", deadline=1.0), 0.0, 2.0, 0.0)
    assert late.refused is not None and (late.refused.reason, late.refused.tenant) == (
        "deadline", "d")
    expired = q.expire(100.0, 0.5)
    assert {(s.key, s.priority, s.tenant) for s in expired} == {
        ("a1", 0, "a"), ("a2", 0, "a"), ("c1", 1, "c")}


def test_the_least_urgent_band_leaves_room_for_an_urgent_arrival() -> None:
    # Bound 1 s; 0.6 s queued. A more urgent request goes (0.6 <= 1); one of the least urgent
    # band with 0.5 s of prefill would leave 1.1 s queued: it waits; with 0.3 s it fits.
    assert has_room(0.6, 0.5, 0.1, True, 0.0, BOUNDS, keep_room=False)
    assert not has_room(0.6, 0.5, 0.1, True, 0.0, BOUNDS, keep_room=True)
    assert has_room(0.6, 0.3, 0.1, True, 0.0, BOUNDS, keep_room=True)
    assert not has_room(1.2, 0.0, 0.1, True, 0.0, BOUNDS, keep_room=False)
    # A prompt longer than the bound (0.95 s of prefill + 0.1 s first iteration) never fits:
    # it goes where no prefill is queued, and waits where some is.
    assert has_room(0.3, 0.95, 0.1, False, 0.0, BOUNDS, keep_room=True)
    assert not has_room(0.3, 0.95, 0.1, True, 0.0, BOUNDS, keep_room=True)
    # One that would fit an idle worker waits for the queue to fall, even with no prefill
    # queued (decodes hold it): it does not take the room.
    assert not has_room(0.5, 0.8, 0.1, False, 0.0, BOUNDS, keep_room=True)
    assert not has_room(0.1, 0.1, 0.1, False, 0.95, BOUNDS, keep_room=False)  # KV is full


def test_the_least_urgent_band_is_the_largest_priority_waiting() -> None:
    q = FlowQueue(BOUNDS)
    hi, lo = item("hi", -1), item("lo", 3)
    assert q.least_urgent(hi)  # nothing waits: an arrival is the least urgent
    q.offer(lo, 0.0, 2.0, 0.0)
    assert not q.least_urgent(hi) and q.least_urgent(lo)
    q.offer(hi, 0.0, 2.0, 0.0)
    assert q.least_urgent(lo) and not q.least_urgent(hi)
