"""Live mode against a fake OpenAI-style streaming server on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from bench.figures import percentile
from bench.live import LATE_S, LiveRecord, read_stream, replay_live, summarize_live
from bench.report import LIVE_COLUMNS, table
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


async def _lines(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


def _token(text: str = "x") -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n"


async def test_each_gap_between_two_tokens_is_recorded_from_the_stream() -> None:
    clock = iter([10.5, 10.75, 11.0, 11.5, 12.0])  # three tokens, [DONE]; one spare
    usage = b"data: " + json.dumps({"choices": [], "usage": {
        "prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}).encode()
    rec = LiveRecord("r", 16)
    await read_stream(_lines(b": comment", _token(), b"", _token(), _token(), usage,
                             b"data: [DONE]", _token()), rec, 10.0, clock.__next__)
    assert rec.ttft_s == 0.5 and rec.e2e_s == 1.5
    assert rec.token_gaps_s == [0.25, 0.25] and rec.tokens_out == 3
    assert (rec.prompt_tokens, rec.cached_tokens) == (40, 32) and rec.error is None


async def test_the_inter_token_latency_is_over_every_gap_of_the_served_requests() -> None:
    fast, slow, failed = LiveRecord("a", 8), LiveRecord("b", 8), LiveRecord("c", 8)
    clocks = [iter([1.0, 1.01, 1.02, 1.03, 1.04]), iter([1.0, 1.5, 2.0]), iter([1.0, 9.0])]
    streams = [_lines(*[_token()] * 4, b"data: [DONE]"),
               _lines(_token(), _token(), b"data: [DONE]"),
               _lines(_token(), _token(),
                      b'data: {"error": {"message": "engine died"}}')]
    for rec, clock, stream in zip((fast, slow, failed), clocks, streams, strict=True):
        await read_stream(stream, rec, 0.9, clock.__next__)
    assert failed.error == "engine died" and failed.token_gaps_s == [8.0]
    row = summarize_live([fast, slow, failed], 2.0)
    gaps = sorted(fast.token_gaps_s + slow.token_gaps_s)  # the failed request's gap is out
    assert len(gaps) == 4 and row["itl_p50_s"] == percentile(gaps, 50)
    assert row["itl_p99_s"] == percentile(gaps, 99) and row["itl_p99_s"] > 0.4
    assert row["output_tok_s"] == (4 + 2) / 2.0


def test_the_live_table_prints_the_inter_token_latency_beside_ttft() -> None:
    rec = LiveRecord("a", 8, ttft_s=0.1, e2e_s=0.3, tokens_out=3, token_gaps_s=[0.1, 0.1])
    text = table([summarize_live([rec], 1.0)], "live", LIVE_COLUMNS)
    head, row = text.splitlines()[1:]
    assert head.index("ITL p50") > head.index("TTFT mean")
    assert "0.1000" in row
