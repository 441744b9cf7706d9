"""The soak's flood classifies each answer as the router's contract says: served, refused at
once (429 with Retry-After, or 503), or lost before its first byte (no answer, a 429 without
Retry-After, any other status)."""

from __future__ import annotations

import random

import aiohttp
from aiohttp import web

from bench.soak import Flood, _flood_body, _flood_one
from kvroute.up import free_port


async def _serve(status: int, headers: dict[str, str] | None = None, close: bool = False,
                 cut: bool = False) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        if cut:  # the status line and a first event, then the connection drops
            response = web.StreamResponse(status=status)
            await response.prepare(request)
            await response.write(b"data: {}\n\n")
            assert request.transport is not None
            request.transport.close()
            return response
        if close:  # drop the connection before any status line
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return web.Response(status=status, headers=headers or {}, body=b"data: {}\n\n")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _one(status: int, cls: str, headers: dict[str, str] | None = None,
               close: bool = False, cut: bool = False) -> Flood:
    runner, base = await _serve(status, headers, close, cut)
    flood = Flood()
    try:
        async with aiohttp.ClientSession() as session:
            await _flood_one(session, base, _flood_body(random.Random(0), cls == "high"), cls,
                             flood)
    finally:
        await runner.cleanup()
    return flood


async def test_served_high_priority_counts_its_ttft() -> None:
    flood = await _one(200, "high")
    assert flood.answers == {("high", "200"): 1}
    assert len(flood.high_ttft_s) == 1 and not flood.lost


async def test_refusals_at_once_are_not_lost() -> None:
    for status, headers in ((429, {"Retry-After": "2"}), (503, None)):
        flood = await _one(status, "low", headers)
        assert flood.answers == {("low", str(status)): 1}
        assert not flood.lost and not flood.high_ttft_s


async def test_a_429_without_retry_after_or_a_502_is_lost() -> None:
    flood = await _one(429, "low")
    assert flood.answers == {("low", "429 no Retry-After"): 1}
    assert flood.lost == {"low: status 429": 1}
    flood = await _one(502, "high")
    assert flood.lost == {"high: status 502": 1} and not flood.high_ttft_s


async def test_a_dropped_connection_is_lost() -> None:
    flood = await _one(200, "low", close=True)
    assert flood.answers == {("low", "no answer"): 1}
    assert sum(flood.lost.values()) == 1


async def test_an_answer_cut_after_its_status_is_not_lost_before_its_first_byte() -> None:
    flood = await _one(200, "low", cut=True)
    assert not flood.lost
    ((cls, answer), n), = flood.answers.items()
    assert (cls, n) == ("low", 1) and answer.startswith("200, then cut")


def test_flood_bodies_carry_their_priority() -> None:
    import json
    rng = random.Random(1)
    high, low = json.loads(_flood_body(rng, True)), json.loads(_flood_body(rng, False))
    assert (high["priority"], low["priority"]) == (0, 10)
    assert len(low["messages"][0]["content"]) > 10 * len(high["messages"][0]["content"])


async def test_a_lost_request_is_told_by_its_id_with_the_routers_lines_for_it() -> None:
    flood = await _one(200, "low", close=True)
    [(rid, why, sent, took)] = flood.lost_requests
    assert rid == "flood-low-1" and why in {"ServerDisconnectedError", "ClientOSError"}
    assert took >= 0
    log = "\n".join([
        "2026-12-02 10:00:00,000 INFO router.http.request_path: the client left before its "
        "answer: 29.9 s queued in flow control, then 30.1 s sent to http://w1 (and any tried "
        "after it) with no answer begun [request flood-low-1]",
        "2026-12-02 10:00:00,000 WARNING router.http.failover: worker http://w1 failed before "
        "answering (hung): no first byte [request flood-low-1]",
        "2026-12-02 10:00:00,000 INFO router.http.request_path: the client left before its "
        "answer: 1.0 s queued in flow control, then 0.0 s sent to http://w2 (and any tried "
        "after it) with no answer begun [request flood-low-10]",
    ])
    lines = flood.stages(log, sent - 5.0)
    assert lines[0] == f"  flood-low-1, sent at 5.0 s, {why} after {took:.1f} s:"
    assert lines[1:] == [
        "    router: the client left before its answer: 29.9 s queued in flow control, then "
        "30.1 s sent to http://w1 (and any tried after it) with no answer begun",
        "    router: worker http://w1 failed before answering (hung): no first byte"]
    assert flood.stages("", sent)[1].startswith("    router: the router logged nothing for it")


async def test_a_cut_answer_is_told_with_its_worker_and_when_its_bytes_stopped() -> None:
    flood = await _one(200, "low", cut=True)
    [(rid, worker, sent, last, took, size)] = flood.cut
    assert rid == "flood-low-1" and worker == "" and size == len(b"data: {}\n\n")
    assert 0 <= last <= took
    [line] = flood.cuts(sent - 2.0, {"http://w1": "worker-1"})
    assert line.startswith(f"  flood-low-1, sent at 2.0 s, answered by : {size} bytes, the "
                           f"last {last:.1f} s after sending, cut at {took:.1f} s")
    flood.cut[0] = (rid, "http://w1", sent, last, took, size)
    assert "answered by worker-1:" in flood.cuts(sent, {"http://w1": "worker-1"})[0]
