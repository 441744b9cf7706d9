"""Flow control's dispatch gate in its shell (:class:`router.http.flow.FlowControl`), driven
by hand: routes are built with the in-flight counts and limits each test names, the clock is
injected, and the dispatcher's safety-net look is set past any test's length, so a request
that leaves the queue left because something told flow control that capacity freed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from openai_request.bodies import ApiError
from router.http.flow import Ask, FlowControl, Refused, ask_of
from router.routing.admission import FlowSettings
from router.routing.scheduler import Decision, WorkerCost
from router.service import Route

#: Longer than any test: no request leaves on the dispatcher's own look.
NEVER = 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """Workers' in-flight counts and limits; builds the routes a decision would give."""

    def __init__(self, **limits: int) -> None:
        self.limits = {int(w[1:]): n for w, n in limits.items()}
        self.in_flight = dict.fromkeys(self.limits, 0)
        self.sent: list[str] = []
        #: Some worker is healthy (else deciding again answers 503, as the service does).
        self.healthy = True

    def route(self, rid: str, ttft_s: float = 0.05) -> Route:
        costs = tuple(WorkerCost(worker=w, matched_blocks=0, device_matched_blocks=0,
                                 prefill_blocks=1, pending_prefill_blocks=0.0,
                                 decode_blocks=0.0, active_requests=n, wait_s=0.0,
                                 prefill_s=0.01, cost=ttft_s, price=ttft_s + n)
                      for w, n in sorted(self.in_flight.items(), key=lambda kv: kv[1]))
        entries: Any = {w: SimpleNamespace(info=SimpleNamespace(max_num_seqs=n, num_blocks=0))
                        for w, n in self.limits.items()}
        prompt: Any = SimpleNamespace(token_ids=[0] * 100)
        return Route(rid, prompt, [], Decision(costs[0].worker, costs), entries, 0.0, 0.0)

    def decide_again(self, route: Route) -> Route:
        """A waiting request decided again, as flow control asks the service."""
        if not self.healthy:
            raise ApiError(503, "no worker is healthy", "service_unavailable")
        return self.route(route.request_id)

    async def send(self, flow: FlowControl, rid: str, priority: int) -> Route:
        """Admit ``rid`` as the request path does; book it on its worker once it leaves."""
        route = await flow.admit(self.route(rid), Ask(priority))
        self.in_flight[route.decision.worker] += 1
        self.sent.append(rid)
        return route

    def end(self, flow: FlowControl, worker: int) -> None:
        self.in_flight[worker] -= 1
        flow.ended()


async def settle() -> None:
    """Let every task that can run, run (no clock involved)."""
    for _ in range(20):
        await asyncio.sleep(0)


def flow_control(clock: Clock, fleet: Fleet, **kw: Any) -> FlowControl:
    return FlowControl(FlowSettings(**kw), fleet.decide_again, clock=clock, tick_s=NEVER)


async def test_a_worker_at_its_limit_gets_nothing_more_and_the_queue_leaves_on_an_end() -> None:
    clock, fleet = Clock(), Fleet(w1=2)
    flow = flow_control(clock, fleet, urgent_share=0.0)
    tasks = [asyncio.create_task(fleet.send(flow, f"r{i}", 0)) for i in range(4)]
    await settle()
    # Two run; two wait in the router, not in the engine.
    assert fleet.sent == ["r0", "r1"] and len(flow.queue) == 2
    fleet.end(flow, 1)  # one sequence frees: the next leaves, and only one
    await settle()
    assert fleet.sent == ["r0", "r1", "r2"] and len(flow.queue) == 1
    fleet.end(flow, 1)
    await settle()
    assert fleet.sent == ["r0", "r1", "r2", "r3"] and not flow.queue
    routes = await asyncio.gather(*tasks)
    assert routes[0].queued is None  # sent at once
    assert routes[3].queued is not None and routes[3].queued.length == 1
    await flow.close()


async def test_a_request_decided_again_as_it_leaves_the_queue_is_timed_by_its_new_id(
        ) -> None:
    # Leaving the queue, a request is decided again, which names it afresh; it ends under
    # that name. Timed under the old one it never ended: the pace read it as running ever
    # longer and shed the queue behind it, and its hold was never learned.
    clock, fleet = Clock(), Fleet(w1=1)
    renamed: dict[str, int] = {}

    def rename(route: Route) -> Route:  # each decision again gives a fresh name
        base = route.request_id.split("-")[0]
        renamed[base] = renamed.get(base, 0) + 1
        return fleet.route(f"{base}-{renamed[base]}")

    flow = FlowControl(FlowSettings(urgent_share=0.0), rename, clock=clock, tick_s=NEVER)

    left: list[str] = []  # the name each request left under, in order

    async def send(rid: str) -> Route:
        route = await flow.admit(fleet.route(rid), Ask(5))
        fleet.in_flight[1] += 1
        left.append(route.request_id)
        return route

    tasks = [asyncio.create_task(send(f"r{i}")) for i in range(5)]
    await settle()
    assert left == ["r0"] and len(flow.queue) == 4  # r0 went at once, under its own name
    for t in range(1, 6):  # each holds the one sequence 1 s; the next leaves as it ends
        clock.now = float(t)
        fleet.in_flight[1] -= 1
        flow.ended(left[-1])
        await settle()
        assert len(left) == min(t + 1, 5)
    await asyncio.gather(*tasks)
    assert [name.split("-")[0] for name in left] == ["r0", "r1", "r2", "r3", "r4"]
    assert all("-" in name for name in left[1:])  # decided again: named afresh
    # 5 ends over 4 s: 1.25 a second; 10 sequences each held 1 s: 10 a second.
    assert flow.rate.per_second(5.0) == pytest.approx(5 / 4)
    assert flow.rate.per_second(5.0, sequences=10) == pytest.approx(10.0)
    await flow.close()


async def test_an_urgent_request_jumps_the_queue_and_takes_the_room_kept_for_it() -> None:
    clock, fleet = Clock(), Fleet(w1=4)  # 4 sequences, one kept (a 1/16 share, at least 1)
    flow = flow_control(clock, fleet)
    lows = [asyncio.create_task(fleet.send(flow, f"low{i}", 10)) for i in range(6)]
    await settle()
    assert fleet.sent == ["low0", "low1", "low2"] and len(flow.queue) == 3
    high = asyncio.create_task(fleet.send(flow, "high", 0))
    await settle()
    # Three lows wait ahead of it in time, none ahead of it in the queue: it takes the room.
    assert fleet.sent[-1] == "high"
    stay = (await high).queued
    assert stay is not None and stay.ahead == 0 and stay.length == 3
    assert fleet.in_flight[1] == 4 and len(flow.queue) == 3
    fleet.end(flow, 1)  # 3 in flight: a low one would leave no room, so none goes
    await settle()
    assert len(flow.queue) == 3
    fleet.end(flow, 1)
    await settle()
    assert fleet.sent[-1] == "low3" and len(flow.queue) == 2
    for _ in range(3):
        fleet.end(flow, 1)
        await settle()
    routes = await asyncio.gather(*lows)
    assert [r.queued.ahead for r in routes[3:] if r.queued] == [0, 1, 2]
    await flow.close()


async def test_a_default_priority_request_uses_every_sequence() -> None:
    clock, fleet = Clock(), Fleet(w1=4)
    flow = flow_control(clock, fleet)
    tasks = [asyncio.create_task(fleet.send(flow, f"r{i}", 0)) for i in range(4)]
    await settle()
    assert len(fleet.sent) == 4 and not flow.queue
    await asyncio.gather(*tasks)
    await flow.close()


async def test_a_request_predicted_past_the_budget_is_refused_at_once_with_a_retry_after(
        ) -> None:
    clock, fleet = Clock(), Fleet(w1=2)
    flow = flow_control(clock, fleet, urgent_share=0.0, ttft_budget_s=10.0)
    for t in range(8):  # 8 ends, one a second up to t = 7: 1 a second at t = 8
        clock.now = float(t)
        flow.ended()
    clock.now = 8.0
    running = [asyncio.create_task(fleet.send(flow, f"run{i}", 5)) for i in range(2)]
    waiting = [asyncio.create_task(fleet.send(flow, f"wait{i}", 5)) for i in range(8)]
    await settle()
    # The 8th waiting waits for 8 ends (8 s) plus its 0.05 s TTFT: within 10 s. A 9th waits
    # 9.05 s: within. A 10th would wait 10.05 s: refused at once, told to come back in 11.
    assert len(flow.queue) == 8 and not any(t.done() for t in waiting)
    assert all(t.done() for t in running)
    ninth = asyncio.create_task(fleet.send(flow, "ninth", 5))
    await settle()
    assert not ninth.done() and len(flow.queue) == 9
    with pytest.raises(Refused) as refused:
        await fleet.send(flow, "tenth", 5)
    assert refused.value.status == 429 and refused.value.reason == "deadline"
    assert refused.value.headers["retry-after"] == "11"
    # A more urgent request has none of them ahead of it: it waits, not refused.
    urgent = asyncio.create_task(fleet.send(flow, "urgent", 0))
    await settle()
    assert not urgent.done() and len(flow.queue) == 10
    assert flow.shed["deadline", "5", "other"] == 1
    await flow.close()
    for t in [*waiting, ninth, urgent]:
        with pytest.raises(ApiError):
            await t


async def test_behind_a_flood_of_long_requests_a_request_is_refused_at_arrival() -> None:
    # The load before: short requests (16 tokens asked) held 0.5 s each, one every 5 s (their
    # ends, 4 over 16 s by then, say a quarter a second). Then 4 long ones (400 tokens asked)
    # take the 4 sequences, and more queue behind them. No long one has ended; their ages
    # (1 s) alone say the queue leaves 4 a second. What they asked says each holds its
    # sequence 400 / 16 * 0.5 = 12.5 s: one leaves every 3.125 s.
    clock, fleet = Clock(), Fleet(w1=4)
    flow = flow_control(clock, fleet, urgent_share=0.0, ttft_budget_s=30.0)

    async def send(rid: str, tokens: int) -> Route:
        route = await flow.admit(fleet.route(rid), Ask(5, output_tokens=tokens))
        fleet.in_flight[1] += 1
        return route

    for i in range(4):
        clock.now = 5.0 * i
        await send(f"short{i}", 16)
        clock.now += 0.5
        fleet.in_flight[1] -= 1
        flow.ended(f"short{i}")
    start = clock.now
    for i in range(4):
        await send(f"long{i}", 400)
    clock.now = start + 1.0
    waiting = [asyncio.create_task(send(f"wait{i}", 400)) for i in range(8)]
    await settle()
    # The 8th waits 8 leavings, 25 s, and 0.05 s of TTFT: within 30 s. A 9th waits 28.2 s:
    # within. A 10th would wait 31.3 s: refused now, not after waiting 20 s to learn it.
    assert len(flow.queue) == 8
    ninth = asyncio.create_task(send("ninth", 400))
    await settle()
    assert len(flow.queue) == 9
    tenth = asyncio.create_task(send("tenth", 400))
    await settle()
    assert tenth.done(), "the tenth was let wait"
    with pytest.raises(Refused) as refused:
        await tenth
    assert refused.value.reason == "deadline" and refused.value.headers["retry-after"] == "32"
    await flow.close()
    for t in [*waiting, ninth]:
        with pytest.raises(ApiError):
            await t


def test_a_request_asks_for_the_output_limit_its_body_names() -> None:
    assert ask_of({"max_tokens": 400}, {}).output_tokens == 400
    assert ask_of({"max_completion_tokens": 64, "max_tokens": 400}, {}).output_tokens == 64
    assert ask_of({"max_output_tokens": 32}, {}).output_tokens == 32
    for body in ({}, {"max_tokens": None}, {"max_tokens": "400"}, {"max_tokens": -1},
                 {"max_tokens": True}, {"max_tokens": 4.5}):
        assert ask_of(body, {}).output_tokens == 0  # none (a bad one is the body check's)


async def test_no_worker_healthy_answers_every_waiting_request_503() -> None:
    clock, fleet = Clock(), Fleet(w1=1)
    flow = flow_control(clock, fleet, urgent_share=0.0)
    first = await fleet.send(flow, "first", 0)
    assert first.queued is None

    waiting = asyncio.create_task(flow.admit(fleet.route("w"), Ask(0)))
    await settle()
    assert len(flow.queue) == 1  # the only worker is at its limit
    fleet.healthy = False  # it left: the next look at the queue finds no worker
    flow.wake()
    with pytest.raises(ApiError) as err:
        await waiting
    assert err.value.status == 503
    await flow.close()
