"""The router app against real HTTP peers on 127.0.0.1: proxying, retries, mid-stream
failure, cancellation, registry checks and bad input."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from router.fleet.unavailable import NO_WORKER_CONFIGURED
from router.http.app import create_app
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, UvicornServer, free_port, sse_events

BODY = {"model": "kvroute-sim", "prompt": "hello router " * 8, "max_tokens": 4}


def settings(*workers: ScriptedWorker, **kw: Any) -> RouterSettings:
    return RouterSettings(workers=tuple(w.url for w in workers), health_interval=0.1, seed=3, **kw)


@contextlib.asynccontextmanager
async def router_for(
    *workers: ScriptedWorker, ready: int | None = None, **kw: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A real router on 127.0.0.1 in front of ``workers``, and a client for it."""
    app = create_app(settings(*workers, **kw))
    async with (UvicornServer(app) as router,
                httpx.AsyncClient(base_url=router.url, timeout=30) as client):
        if ready is not None:
            await wait_ready(client, ready)
        yield client


async def wait_ready(client: httpx.AsyncClient, workers: int) -> None:
    await eventually(lambda: client.get("/ready"), f"the router ready with {workers} workers",
                     until=lambda r: r.status_code == 200 and r.json()["workers"] == workers)


async def test_streaming_passes_through_with_routing_headers() -> None:
    async with ScriptedWorker() as worker, router_for(worker, ready=1) as client:
        r = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200
    assert r.headers["x-kvroute-worker"] == worker.url
    assert r.headers["x-kvroute-matched-blocks"] == "0"
    events = sse_events(r.content)
    assert events[-1] == "[DONE]" and len(events) == 4
    assert worker.requests[0]["prompt"] == BODY["prompt"]  # the body is forwarded unchanged


async def test_a_whole_answer_passes_through_with_its_type_length_and_routing_headers(
) -> None:
    async with ScriptedWorker() as worker, router_for(worker, ready=1) as client:
        r = await client.post("/v1/completions", json=BODY)
        not_post = await client.get("/v1/chat/completions")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert int(r.headers["content-length"]) == len(r.content)
    assert r.json()["choices"] == [{"index": 0, "text": "ok"}]
    assert (r.headers["x-kvroute-worker"], r.headers["x-kvroute-worker-id"]) == (worker.url, "0")
    assert not_post.status_code == 405


async def test_a_worker_failing_before_its_first_byte_is_retried_elsewhere() -> None:
    async with (
        ScriptedWorker("refuse") as bad,
        ScriptedWorker() as good,
        router_for(bad, good, ready=2) as client,
    ):
        answers = [
            await client.post("/v1/completions", json={**BODY, "prompt": f"request {i} " * 20})
            for i in range(12)
        ]
    assert [a.status_code for a in answers] == [200] * 12
    assert all(a.headers["x-kvroute-worker"] == good.url for a in answers)
    assert len(bad.requests) >= 1, "the refusing worker was tried first at least once"
    assert len(good.requests) == 12


async def test_when_every_worker_fails_the_client_gets_503_with_a_reason() -> None:
    async with (
        ScriptedWorker("refuse") as a,
        ScriptedWorker("refuse") as b,
        router_for(a, b, ready=2) as client,
    ):
        r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable"
    assert len(a.requests) + len(b.requests) == 2, "one try and one retry, no more"


async def test_a_failure_mid_stream_ends_with_an_error_event() -> None:
    async with ScriptedWorker("die_mid_stream") as worker, router_for(worker, ready=1) as client:
        r = await client.post("/v1/completions", json={**BODY, "stream": True})
    events = sse_events(r.content)
    # The worker's chunks that arrived before the failure pass through (aiohttp may surface
    # the broken connection before handing over what it buffered), then the error event.
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and events[-2]["error"]["type"] == "upstream_error"
    assert events[:-2] == [{"choices": [{"index": 0, "text": "x"}]}] * (len(events) - 2)
    assert len(events) - 2 <= 2


async def test_a_client_that_goes_away_cancels_the_upstream_request() -> None:
    async with ScriptedWorker("slow") as worker, router_for(worker, ready=1) as client:
        async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            async for _ in r.aiter_bytes():
                break  # one chunk, then hang up
        await asyncio.wait_for(worker.cancelled.wait(), 5)
        load = (await client.post("/debug/route", json=BODY)).json()
    assert load["workers"][0]["active_requests"] == 0, "the cancelled request was released"


async def test_a_client_leaving_a_whole_answer_cancels_the_upstream_request() -> None:
    async with ScriptedWorker("slow") as worker, router_for(worker, ready=1) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=BODY, timeout=0.3)  # hangs up at 0.3 s
        await asyncio.wait_for(worker.cancelled.wait(), 5)
        load = (await client.post("/debug/route", json=BODY)).json()
    assert load["workers"][0]["active_requests"] == 0


async def test_a_worker_with_another_block_size_is_refused_loudly() -> None:
    async with (
        ScriptedWorker(block_size=16) as odd,
        ScriptedWorker() as fine,
        router_for(fine, ready=1) as client,
    ):
        r = await client.post("/workers", json={"url": odd.url})
        listed = (await client.get("/workers")).json()["workers"]
    assert r.status_code == 409
    assert "block size 16" in r.json()["error"]["message"]
    assert "32" in r.json()["error"]["message"]
    assert [w["url"] for w in listed] == [fine.url]


async def test_a_new_instance_id_is_seen_as_a_restart() -> None:
    async with ScriptedWorker() as worker, router_for(worker, ready=1) as client:
        # the worker goes away and comes back as a new instance
        worker.instance_id = "scripted-2"
        await worker.__aexit__(None, None, None)
        await eventually(lambda: client.get("/ready"), "the router to see it gone",
                         until=lambda r: r.status_code == 503)
        await worker.__aenter__()
        await wait_ready(client, 1)
        described = (await client.get("/workers")).json()["workers"][0]
    assert described["instance_id"] == "scripted-2"
    assert described["counters"]["restarts"] == 1


@pytest.mark.parametrize(
    "body, status, kind",
    [
        (b"{not json", 400, "invalid_request_error"),
        (b"[1, 2]", 400, "invalid_request_error"),
        (b'{"model": "no-such-model", "prompt": "x"}', 404, "invalid_request_error"),
        (b'{"model": "kvroute-sim"}', 400, "invalid_request_error"),
        (b'{"model": "kvroute-sim", "prompt": ["a", "b"]}', 400, "invalid_request_error"),
        (b'{"model": "kvroute-sim", "prompt": [1.5, 2]}', 400, "invalid_request_error"),
        (b'{"model": "kvroute-sim", "prompt": [-1, 2]}', 400, "invalid_request_error"),
    ],
)
async def test_bad_bodies_get_openai_errors(body: bytes, status: int, kind: str) -> None:
    async with ScriptedWorker() as worker, router_for(worker, ready=1) as client:
        r = await client.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    assert r.status_code == status
    error = r.json()["error"]
    assert error["type"] == kind and error["message"]
    assert worker.requests == [], "nothing bad reached the worker"


async def test_no_worker_means_503_and_not_ready_saying_why(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "router.fleet.registry"):
        async with router_for() as client:
            ready = await client.get("/ready")
            r = await client.post("/v1/completions", json=BODY)
    assert ready.status_code == 503
    assert ready.json()["reason"] == f"no healthy worker: {NO_WORKER_CONFIGURED}"
    assert r.status_code == 503
    assert r.json()["error"]["message"] == f"no worker is available: {NO_WORKER_CONFIGURED}"
    assert [m.getMessage() for m in caplog.records] == [NO_WORKER_CONFIGURED]


async def test_workers_that_are_down_are_named_in_the_503_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    # Two configured workers nobody listens on: each is logged once however many polls fail.
    down = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with caplog.at_level(logging.WARNING, "router.fleet.registry"):
        app = create_app(RouterSettings(workers=tuple(down), health_interval=0.02, seed=3))
        async with UvicornServer(app) as router, httpx.AsyncClient(base_url=router.url) as c:
            for _ in range(200):  # until several polls have failed for both
                failures = [w["counters"].get("health_failures", 0)
                            for w in (await c.get("/workers")).json()["workers"]]
                if min(failures) >= 3:
                    break
                await asyncio.sleep(0.02)
            r = await c.post("/v1/completions", json=BODY)
            ready = await c.get("/ready")
    assert min(failures) >= 3
    assert r.json()["error"]["message"] == (
        "no worker is available: 2 unhealthy (connection refused)")
    assert ready.json()["reason"] == "no healthy worker: 2 unhealthy (connection refused)"
    said = [m.getMessage() for m in caplog.records]
    for url in down:
        assert len([m for m in said if url in m]) == 1, said


async def test_admin_endpoints_need_the_token() -> None:
    async with (
        ScriptedWorker() as worker,
        router_for(worker, admin_token="s3cret", ready=1) as client,
    ):
        denied = await client.get("/workers")
        allowed = await client.get("/workers", headers={"Authorization": "Bearer s3cret"})
    assert denied.status_code == 401
    assert allowed.status_code == 200


async def test_approximate_mode_sends_a_repeated_prefix_back_to_its_worker() -> None:
    async with ScriptedWorker() as a, ScriptedWorker() as b, router_for(a, b, ready=2) as client:
        first = await client.post("/v1/completions", json={**BODY, "prompt": "p" * 400})
        again = await client.post("/v1/completions", json={**BODY, "prompt": "p" * 400 + " more"})
    assert again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    assert int(again.headers["x-kvroute-matched-blocks"]) == 400 // 32


@pytest.mark.parametrize(("rates", "prefill_s"), [(None, 1.94e-6), ("prefill=1e-5", 1e-5)])
async def test_debug_route_shows_each_workers_price_in_seconds(
        rates: str | None, prefill_s: float) -> None:
    # An idle worker: no wait; the prompt's prefill at its rates (the default or set by hand).
    # Idle, it is priced at its TTFT, a TTFT objective or not.
    async with ScriptedWorker() as a, router_for(a, ready=1, rates=rates,
                                                 ttft_slo=30.0) as client:
        shown = (await client.post("/debug/route", json=BODY)).json()
    (worker,) = shown["workers"]
    blocks = shown["request_blocks"]
    assert worker["within_slo"] is False and worker["price"] == worker["cost"]
    assert worker["wait_s"] == 0.0 and worker["rate_factor"] == 1.0
    assert worker["prefill_blocks"] == blocks and worker["cost"] >= worker["prefill_s"]
    assert worker["prefill_s"] >= prefill_s * 32 * blocks


@pytest.mark.parametrize("policy", ["kv", "round_robin"])
async def test_policy_round_robin_ignores_the_prefix_kv_follows_it(policy: str) -> None:
    async with (
        ScriptedWorker() as a,
        ScriptedWorker() as b,
        router_for(a, b, ready=2, policy=policy) as client,
    ):
        answers = [await client.post("/v1/completions", json=BODY) for _ in range(6)]
    assert [r.status_code for r in answers] == [200] * 6
    chosen = [r.headers["x-kvroute-worker"] for r in answers]
    if policy == "kv":  # the first request's prefix is predicted resident: the rest follow it
        assert len(set(chosen)) == 1
    else:
        assert chosen[0::2] == [chosen[0]] * 3 and chosen[1::2] == [chosen[1]] * 3
        assert chosen[0] != chosen[1]


@pytest.mark.parametrize("sessions", [True, False])
async def test_a_chat_turn_is_seen_as_its_sessions_continuation(sessions: bool) -> None:
    off = {} if sessions else {"sessions": False}
    async with (
        ScriptedWorker() as a,
        ScriptedWorker() as b,
        router_for(a, b, ready=2, **off) as client,
    ):
        first = await client.post("/v1/completions", json={**BODY, "prompt": "p" * 400})
        turn = {**BODY, "prompt": "p" * 400 + " and then " + "q" * 100}
        debug = (await client.post("/debug/route", json=turn)).json()
        fresh = (await client.post("/debug/route", json={**BODY, "prompt": "z" * 400})).json()
        metrics = (await client.get("/metrics")).text
    home = int(first.headers["x-kvroute-worker-id"])
    if sessions:
        assert debug["continues_session_on"] == home and debug["chosen_id"] == home
        assert {w["id"]: w["sessions"] for w in debug["workers"]} == {home: 1, 1 - home: 0}
        assert f'kvroute_sessions{{worker="{home}"}} 1.0' in metrics
    else:
        assert debug["continues_session_on"] is None and "kvroute_sessions" not in metrics
    assert fresh["continues_session_on"] is None


@pytest.mark.parametrize("url, fragment", [
    ("http://[::1", "http://[::1"),
    ("http://127.0.0.1:99999", "port"),
    ("http://:8000", "no host"),
])
async def test_a_malformed_worker_url_is_a_one_line_400(url: str, fragment: str) -> None:
    async with ScriptedWorker() as worker, router_for(worker, ready=1) as client:
        r = await client.post("/workers", json={"url": url})
        listed = (await client.get("/workers")).json()["workers"]
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert fragment in message and "\n" not in message
    assert [w["url"] for w in listed] == [worker.url]


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"])
async def test_no_api_description_is_served(path: str) -> None:
    # It would list the admin endpoints to anyone; the reference is docs/.
    async with ScriptedWorker() as worker, router_for(worker, admin_token="s3cret") as client:
        r = await client.get(path)
        with_token = await client.get(path, headers={"Authorization": "Bearer s3cret"})
    assert (r.status_code, with_token.status_code) == (404, 404)


async def test_a_request_without_a_model_goes_to_any_worker() -> None:
    # As vLLM's server allows (README): no model, and the worker answers as its own.
    async with ScriptedWorker() as worker, router_for(worker, ready=1) as client:
        r = await client.post("/v1/completions", json={"prompt": "no model named " * 4})
    assert r.status_code == 200 and r.headers["x-kvroute-worker"] == worker.url
    assert "model" not in worker.requests[0]


@pytest.mark.parametrize("policy", ["kv", "dynamo"])
async def test_an_answer_carries_the_predicted_ttft_under_the_rule_in_seconds(
        policy: str) -> None:
    async with ScriptedWorker() as a, router_for(a, ready=1, policy=policy) as client:
        shown = (await client.post("/debug/route", json=BODY)).json()
        answer = await client.post("/v1/completions", json=BODY)
    predicted = answer.headers.get("x-kvroute-predicted-ttft-ms")
    if policy == "dynamo":  # its costs are blocks, not seconds
        assert predicted is None
    else:
        (worker,) = shown["workers"]
        assert float(predicted) == pytest.approx(worker["cost"] * 1e3, abs=0.05)
