"""Live mode against a fake OpenAI-style streaming server on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import Awaitable, Callable

from aiohttp import web

from bench.live import LATE_S, replay_live, summarize_live
from bench.workloads import WorkloadRequest


async def start_fake(seen: list[dict]) -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await resp.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode()
                             + b"\n\n")
        usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 4}}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return await serve(completions)


async def serve(completions: Callable[[web.Request], Awaitable[web.StreamResponse]]
                ) -> tuple[web.AppRunner, str]:
    """Serve ``completions`` at ``/v1/completions`` on a free loopback port."""
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_live_replay_streams_token_prompts_and_measures_latency() -> None:
    seen: list[dict] = []
    runner, url = await start_fake(seen)
    try:
        reqs = [WorkloadRequest(f"r{i}", 0.01 * i, (tuple(range(4, 20)),), 16, 3)
                for i in range(3)]
        records, makespan = await replay_live(url, reqs, concurrency=2)
    finally:
        await runner.cleanup()
    assert [b["prompt"] for b in seen] == [list(range(4, 20))] * 3
    assert all(b["stream"] and b["max_tokens"] == 3 for b in seen)
    assert all(r.error is None and r.tokens_out == 3 and 0 <= r.ttft_s <= r.e2e_s
               for r in records)
    row = summarize_live(records, makespan)
    assert row["hit_rate"] == 4 / 16 and row["errors"] == 0


async def test_live_counts_a_refused_connection_as_an_error() -> None:
    reqs = [WorkloadRequest("r", 0.0, ((5, 6),), 2, 1)]
    records, _ = await replay_live("http://127.0.0.1:9", reqs)
    assert records[0].error is not None
    assert summarize_live(records, 1.0)["errors"] == 1


async def test_a_request_the_client_holds_back_counts_its_wait() -> None:
    # The upstream holds each answer 0.2 s (a floor: a loaded machine only lengthens it). All
    # three requests are due at 0; with one in flight at most, each is sent only after the one
    # before has ended, and every time counts from the due time, so the orderings below hold
    # on any machine.
    in_flight, most = [0], [0]

    async def slow(request: web.Request) -> web.StreamResponse:
        await request.json()
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            await asyncio.sleep(0.2)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode()
                             + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            in_flight[0] -= 1

    runner, url = await serve(slow)
    try:
        reqs = [WorkloadRequest(f"r{i}", 0.0, ((5, 6),), 2, 1) for i in range(3)]
        records, _ = await replay_live(url, reqs, concurrency=1)  # all three due at once
    finally:
        await runner.cleanup()
    assert most[0] == 1
    sent = sorted(records, key=lambda r: r.send_delay_s)
    for before, after in itertools.pairwise(sent):
        assert after.send_delay_s >= before.e2e_s  # sent once the one before had ended
    assert all(r.send_delay_s <= r.ttft_s <= r.e2e_s for r in records)  # the wait counts
    row = summarize_live(records, 1.0)
    assert row["errors"] == 0
    assert row["late_sends"] == sum(r.send_delay_s > LATE_S for r in records) >= 2


async def test_the_routers_predicted_ttft_gives_the_prediction_error() -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        # The fake "router" predicts 1 ms for the first prompt and garbage for the second.
        predicted = "1.0" if body["prompt"][0] == 4 else "not a number"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "x-kvroute-predicted-ttft-ms": predicted})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    runner, url = await serve(completions)
    try:
        reqs = [WorkloadRequest(f"r{i}", 0.0, ((4 + i, 5),), 2, 1) for i in range(2)]
        records, makespan = await replay_live(url, reqs)
    finally:
        await runner.cleanup()
    by_id = {r.request_id: r for r in records}
    assert by_id["r0"].predicted_ttft_s == 0.001 and by_id["r1"].predicted_ttft_s == -1.0
    row = summarize_live(records, makespan)
    ttft = by_id["r0"].ttft_s
    assert row["prediction_error"] == abs(0.001 - ttft) / ttft
    assert math.isnan(summarize_live(records[1:], makespan)["prediction_error"])  # none sent
