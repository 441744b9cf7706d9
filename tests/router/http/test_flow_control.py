"""Flow control end to end: a real router on 127.0.0.1 in front of paced workers (each stream
waits until the test ends it), driven past saturation.

The rates are set by hand (a millisecond of prefill per token, nothing learned), so the work
queued on a worker is the predicted prefill of the requests in flight there: with the bound
of 0.2 s, a worker holding one prompt of 7 or 12 blocks (0.224 s or 0.384 s) is saturated,
and the tests decide exactly how many requests are in flight. A held stream sends no byte
until the test ends it, so the first-byte deadline is set past any test's length. Nothing
here waits for a clock: each step waits (bounded) for a state the router reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx

from router.http.app import create_app
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, UvicornServer

#: 7 and 12 full blocks of 32 bytes-tokens: 0.224 s and 0.384 s of predicted prefill; 3
#: blocks, 0.096 s: two fit under the bound, a third does not.
SHORT, LONG, SMALL = 7 * 32 + 8, 12 * 32 + 8, 3 * 32 + 8


@contextlib.asynccontextmanager
async def router(*workers: ScriptedWorker, **kw: Any
                 ) -> AsyncIterator[httpx.AsyncClient]:
    settings = RouterSettings(workers=tuple(w.url for w in workers), health_interval=0.1,
                              seed=3, rates="prefill=0.001", learn_rates=False,
                              flow_ttft_bound=0.2, first_byte_floor=120.0, **kw)
    async with UvicornServer(create_app(settings)) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=60,
                              limits=httpx.Limits(max_connections=None)) as client:
        await eventually(lambda: client.get("/ready"), f"{len(workers)} workers ready",
                         until=lambda r: r.status_code == 200
                         and r.json()["workers"] == len(workers))
        yield client


def body(tag: str, size: int, **extra: Any) -> dict[str, Any]:
    text = f"<{tag}>"
    return {"model": "kvroute-sim", "prompt": text + "x" * (size - len(text)), "max_tokens": 1,
            "stream": True, **extra}


def tag_of(request: dict[str, Any]) -> str:
    found = re.match(r"<([^>]*)>", request["prompt"])
    assert found, request
    return found.group(1)


async def queued(client: httpx.AsyncClient) -> int:
    text = (await client.get("/metrics")).text
    return int(sum(float(v) for v in re.findall(r"^kvroute_flow_queued\{[^}]*\} (\S+)$",
                                                  text, re.M)))


async def shed(client: httpx.AsyncClient, reason: str) -> float:
    """Requests refused for ``reason``, whatever their priority and tenant."""
    text = (await client.get("/metrics")).text
    return sum(float(v) for v in re.findall(
        rf'^kvroute_flow_shed_total\{{[^}}]*reason="{reason}"[^}}]*\}} (\S+)$', text, re.M))


async def post(client: httpx.AsyncClient, payload: dict[str, Any],
               headers: dict[str, str] | None = None) -> httpx.Response:
    response = await client.post("/v1/completions", json=payload, headers=headers)
    await response.aread()
    return response


async def wait_for(what: str, check: Any) -> None:
    async def probe() -> bool:
        return bool(await check())
    await eventually(probe, what, 30.0, until=bool)


def drain(*workers: ScriptedWorker, n: int) -> None:
    """End every stream now open and the next ``n`` ones as they begin."""
    for w in workers:
        for _ in range(n):
            w.finish()


async def test_a_high_priority_request_passes_a_queued_low_priority_flood() -> None:
    async with ScriptedWorker("paced") as a, ScriptedWorker("paced") as b, \
            router(a, b, flow_max_queue=6) as client:
        # Two workers, one request each until saturated; 12 low-priority requests: 2 go, 6
        # wait, 4 find the queue full.
        low = [asyncio.create_task(post(client, body(f"low{i}", SHORT, priority=5)))
               for i in range(12)]
        await wait_for("2 sent, 6 queued", lambda: _both(
            len(a.requests) + len(b.requests) == 2, queued(client), 6))
        refused = [t for t in low if t.done()]
        assert len(refused) == 4
        for t in refused:
            answer = t.result()
            assert answer.status_code == 429
            assert int(answer.headers["retry-after"]) >= 1
            assert answer.json()["error"]["code"] == "queue_full"
        high = asyncio.create_task(post(client, body("high", SHORT),
                                        {"x-kvroute-priority": "-1"}))
        # The queue is full: the high one displaces the least urgent low one (429 at once).
        await wait_for("a low one displaced", lambda: _displaced(client))
        assert await queued(client) == 6
        a.finish()  # one slot frees: the high-priority request takes it, not a queued low one
        await wait_for("a third request sent",
                       lambda: _true(len(a.requests) + len(b.requests) == 3))
        third = [tag_of(r) for r in a.requests + b.requests]
        assert "high" in third
        drain(a, b, n=20)
        answers = await asyncio.gather(high, *low)
    statuses = Counter(r.status_code for r in answers)
    assert statuses == {200: 8, 429: 5}  # every request answered: served or refused


async def test_the_low_band_leaves_the_room_an_urgent_arrival_takes() -> None:
    async with ScriptedWorker("paced") as w, router(w) as client:
        # Arrivals to a queue with nobody waiting go while the queued work is within 0.2 s:
        # 0, 0.096, 0.192 s; the fourth and fifth find 0.288 s and wait.
        low = [asyncio.create_task(post(client, body(f"low{i}", SMALL, priority=5)))
               for i in range(5)]
        await wait_for("3 sent, 2 queued",
                       lambda: _both(len(w.requests) == 3, queued(client), 2))
        w.finish()  # 0.192 s queued: the next low one would leave 0.288 s, so it stays
        await wait_for("the first answered", lambda: _true(low[0].done()))
        assert len(w.requests) == 3 and await queued(client) == 2
        # An urgent arrival finds 0.192 s queued, within the bound: it goes at once.
        high = asyncio.create_task(post(client, body("high", SMALL),
                                        {"x-kvroute-priority": "-1"}))
        await wait_for("the urgent one sent", lambda: _true(len(w.requests) == 4))
        assert tag_of(w.requests[3]) == "high" and await queued(client) == 2
        w.finish()
        w.finish()  # 0.096 s queued: a low one fits again (0.192 s), the last does not
        await wait_for("a queued low one sent", lambda: _true(len(w.requests) == 5))
        assert await queued(client) == 1
        drain(w, n=5)
        answers = await asyncio.gather(high, *low)
    assert all(r.status_code == 200 for r in answers)


async def test_equal_tenants_get_equal_tokens_when_one_sends_ten_times_more() -> None:
    async with ScriptedWorker("paced") as w, router(w, flow_max_queue=200) as client:
        # Tenant a: 100 short prompts; tenant b: 10 long ones; all queued behind the first.
        tasks = [asyncio.create_task(post(client, body(f"a{i}", SHORT),
                                          {"x-kvroute-tenant": "a"})) for i in range(100)]
        await wait_for("a's first sent, the rest queued",
                       lambda: _both(len(w.requests) == 1, queued(client), 99))
        tasks += [asyncio.create_task(post(client, body(f"b{i}", LONG),
                                           {"x-kvroute-tenant": "b"})) for i in range(10)]
        await wait_for("b's queued", lambda: _both(True, queued(client), 109))
        # One at a time: end the stream in flight, the queue sends the next.
        sent = 1
        while sum(tag_of(r).startswith("b") for r in w.requests) < 10:
            assert sent < 110, "b's requests never all left the queue"
            w.finish()
            sent += 1
            await wait_for(f"request {sent} sent",
                           lambda n=sent: _true(len(w.requests) == n))  # type: ignore[misc]
        tokens = Counter[str]()
        for r in w.requests[1:]:  # those that left the queue, while b still waited
            tokens[tag_of(r)[0]] += len(r["prompt"])
        assert abs(tokens["a"] - tokens["b"]) <= 0.1 * tokens["b"], tokens
        drain(w, n=120)
        answers = await asyncio.gather(*tasks)
    assert all(r.status_code == 200 for r in answers)


async def test_an_unmeetable_deadline_is_refused_at_once_and_a_meetable_one_served() -> None:
    async with ScriptedWorker("paced") as w, router(w) as client:
        first = asyncio.create_task(post(client, body("first", SHORT),
                                         {"x-kvroute-ttft-deadline-ms": "5000"}))
        await wait_for("the first sent", lambda: _true(len(w.requests) == 1))
        # The worker holds the first: a request due in 100 ms cannot be served in time.
        late = await post(client, body("late", SHORT), {"x-kvroute-ttft-deadline-ms": "100"})
        assert late.status_code == 429
        assert late.json()["error"]["code"] == "deadline_unmeetable"
        assert int(late.headers["retry-after"]) >= 1
        # It was answered while the only worker was still busy, and never sent there.
        assert not first.done() and [tag_of(r) for r in w.requests] == ["first"]
        assert await shed(client, "deadline") == 1
        bad = await post(client, body("bad", SHORT), {"x-kvroute-ttft-deadline-ms": "soon"})
        assert bad.status_code == 400
        drain(w, n=2)
        assert (await first).status_code == 200


async def test_debug_route_says_why_a_request_would_wait() -> None:
    async with ScriptedWorker("paced") as w, router(w) as client:
        idle = (await client.post("/debug/route", json=body("x", SHORT))).json()["flow"]
        assert idle["would"] == "dispatch" and not idle["fleet_saturated"]
        first = asyncio.create_task(post(client, body("first", SHORT)))
        await wait_for("the first sent", lambda: _true(len(w.requests) == 1))
        busy = (await client.post("/debug/route", json=body("x", SHORT))).json()["flow"]
        assert busy["would"] == "wait" and busy["fleet_saturated"]
        assert busy["workers"][0]["saturated"] and busy["workers"][0]["queued_s"] > 0.2
        drain(w, n=1)
        await first


async def test_flow_metrics_label_named_tenants_and_pool_the_rest_as_other() -> None:
    async with ScriptedWorker("paced") as w, router(w, tenant_weights="gold=2") as client:
        first = asyncio.create_task(post(client, body("first", SHORT)))
        await wait_for("the first sent", lambda: _true(len(w.requests) == 1))
        tasks = [asyncio.create_task(post(client, body(f"q{i}", SHORT, priority=p),
                                          {"x-kvroute-tenant": t}))
                 for i, (t, p) in enumerate([("gold", 0), ("x", 0), ("y", 0), ("y", 2)])]
        tasks.append(asyncio.create_task(post(client, body("anon", SHORT))))
        await wait_for("5 queued", lambda: _both(True, queued(client), 5))
        text = (await client.get("/metrics")).text
        assert re.findall(r'^kvroute_flow_queued\{([^}]*)\} (\S+)$', text, re.M) == [
            ('priority="0",tenant="gold"', "1.0"), ('priority="0",tenant="other"', "3.0"),
            ('priority="2",tenant="other"', "1.0")]
        late = await post(client, body("late", SHORT), {"x-kvroute-tenant": "gold",
                                                        "x-kvroute-ttft-deadline-ms": "100"})
        assert late.status_code == 429
        text = (await client.get("/metrics")).text
        assert re.findall(r'^kvroute_flow_shed_total\{([^}]*)\} (\S+)$', text, re.M) == [
            ('priority="0",reason="deadline",tenant="gold"', "1.0")]
        drain(w, n=6)
        assert all(r.status_code == 200 for r in await asyncio.gather(first, *tasks))
        text = (await client.get("/metrics")).text
        waits = dict(re.findall(
            r'^kvroute_flow_wait_seconds_count\{([^}]*)\} (\S+)$', text, re.M))
        assert waits == {'priority="0",tenant="gold"': "1.0",
                         'priority="0",tenant="other"': "3.0",
                         'priority="2",tenant="other"': "1.0"}


async def test_with_flow_control_off_nothing_waits() -> None:
    async with ScriptedWorker("paced") as w, router(w, flow_control=False) as client:
        tasks = [asyncio.create_task(post(client, body(f"r{i}", SHORT))) for i in range(4)]
        await wait_for("all 4 sent to the saturated worker",
                       lambda: _true(len(w.requests) == 4))
        assert await queued(client) == 0
        drain(w, n=4)
        assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))


async def _displaced(client: httpx.AsyncClient) -> bool:
    return await shed(client, "displaced") == 1


async def _true(value: bool) -> bool:
    return value


async def _both(first: bool, count: Any, expected: int) -> bool:
    return await count == expected and first
