"""The router's control plane and failover against real HTTP peers on 127.0.0.1: garbage
control answers, hung workers, a worker too small for a prompt, failures before the first
byte."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.router.test_router_service import BODY, router_for
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, sse_events


def counted(metrics: str, name: str, label: str) -> float:
    """The sum of ``name``'s samples whose labels hold ``label``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") and label in line)


async def described(client: httpx.AsyncClient, worker: ScriptedWorker) -> dict[str, Any]:
    workers = (await client.get("/workers")).json()["workers"]
    return next(w for w in workers if w["url"] == worker.url)  # type: ignore[no-any-return]


def queued_blocks(route: dict[str, Any], worker: ScriptedWorker) -> float:
    """The prefill blocks a ``/debug/route`` answer weighs as queued on ``worker``."""
    return next(w["pending_prefill_blocks"] for w in route["workers"] if w["url"] == worker.url)


async def wait_state(client: httpx.AsyncClient, worker: ScriptedWorker, state: str
                     ) -> dict[str, Any]:
    return await eventually(lambda: described(client, worker), f"{worker.url} {state}",
                            until=lambda entry: entry["state"] == state)


async def test_a_load_answer_out_of_range_marks_that_worker_and_polling_goes_on() -> None:
    async with (
        ScriptedWorker() as bad,
        ScriptedWorker() as good,
        router_for(bad, good, ready=2) as client,
    ):
        bad.load_answer = b'{"running": 1e999}'
        entry = await wait_state(client, bad, "unhealthy")
        assert "running" in entry["last_error"], entry["last_error"]
        # only the other worker is a candidate now (the registry's kept list followed)
        assert (await client.get("/ready")).json() == {"ready": True, "workers": 1}
        # the poll loop still runs: the other worker's hang is seen
        good.pause()
        good_id = (await wait_state(client, good, "unhealthy"))["id"]
        assert (await client.get("/ready")).status_code == 503
        # and the garbage one comes back once it answers sensibly
        bad.load_answer = b'{"running": 0}'
        await wait_state(client, bad, "healthy")
        assert (await client.get("/ready")).json() == {"ready": True, "workers": 1}
        metrics = (await client.get("/metrics")).text
    assert counted(metrics, "kvroute_health_failures_total", f'worker="{entry["id"]}"') >= 1
    assert counted(metrics, "kvroute_health_failures_total", f'worker="{good_id}"') >= 1


async def test_a_malformed_model_info_on_reconnect_marks_that_worker_and_polling_goes_on(
) -> None:
    async with (
        ScriptedWorker() as bad,
        ScriptedWorker() as good,
        router_for(bad, good, ready=2) as client,
    ):
        bad.load_answer = b"not json"
        await wait_state(client, bad, "unhealthy")
        bad.model_info_extra = {"data_parallel_rank": "x"}
        bad.load_answer = b'{"running": 0}'
        # reconnecting reads /model_info anew: the bad rank keeps it out, with the reason
        await eventually(lambda: described(client, bad), "the bad rank named",
                         until=lambda w: "data_parallel_rank" in (w["last_error"] or ""))
        assert (await described(client, bad))["state"] == "unhealthy"
        good.pause()
        await wait_state(client, good, "unhealthy")


async def test_a_worker_slow_to_reconnect_delays_no_other_workers_check() -> None:
    # The router's own poll loop (tests/router/fleet/test_health_polling.py drives the same
    # rounds one at a time).
    async with (
        ScriptedWorker() as slow,
        ScriptedWorker() as good,
        router_for(slow, good, ready=2) as client,
    ):
        slow.load_answer = b"not json"
        await wait_state(client, slow, "unhealthy")
        slow.hang_model_info()
        before = slow.model_info_calls
        assert slow.model_info_ended == before
        slow.load_answer = b'{"running": 0}'
        await eventually(lambda: slow.model_info_calls > before, "its reconnect to begin")
        good.load_answer = b"not json"  # an answer, at once: no timeout in the way
        await wait_state(client, good, "unhealthy")
        # seen while the other's /model_info call still waits (the router allows it 5 s)
        assert slow.model_info_ended == before


async def test_a_prompt_goes_to_a_worker_it_fits_and_400_only_when_none_fits() -> None:
    async with (
        ScriptedWorker(max_model_len=128) as small,
        ScriptedWorker(max_model_len=65536) as large,
        router_for(small, large, ready=2) as client,
    ):
        answers = [await client.post("/v1/completions",
                                     json={**BODY, "prompt": f"{i} " + "x" * 4200})
                   for i in range(4)]
        assert [a.status_code for a in answers] == [200] * 4
        assert {a.headers["x-kvroute-worker"] for a in answers} == {large.url}
        short = [await client.post("/v1/completions", json={**BODY, "prompt": f"short {i}"})
                 for i in range(8)]
        assert {a.headers["x-kvroute-worker"] for a in short} == {small.url, large.url}
        too_long = await client.post("/v1/completions", json={**BODY, "prompt": "x" * 70000})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        assert "65536" in too_long.json()["error"]["message"]


async def test_a_stream_the_engine_failed_before_its_first_token_is_retried_elsewhere(
) -> None:
    async with (
        ScriptedWorker("fail_stream") as bad,
        ScriptedWorker() as good,
        router_for(bad, good, ready=2) as client,
    ):
        answers = [await client.post("/v1/completions", json={
            **BODY, "prompt": f"request {i} " * 20, "stream": True}) for i in range(12)]
    assert len(bad.requests) >= 1, "the failing worker was tried first at least once"
    for a in answers:
        events = sse_events(a.content)
        assert a.status_code == 200 and a.headers["x-kvroute-worker"] == good.url
        assert not any(isinstance(e, dict) and "error" in e for e in events), events
        assert events[-1] == "[DONE]"


async def test_a_stream_that_never_begins_is_sent_elsewhere_at_its_deadline() -> None:
    # The stalled worker's /load still answers and it sends a stream's headers: only the
    # request's own first-byte deadline (the floor, here 0.3 s) can move it. The other worker
    # reports a deep queue, so every request tries the stalled one first (and its deadline
    # passes however loaded the machine is: it never answers) and then the busy one, which
    # as a fallback waits the proxy's ceiling, not the floor.
    async with (
        ScriptedWorker("stall") as stalled,
        ScriptedWorker() as busy,
    ):
        busy.load_answer = b'{"running": 0, "waiting": 64, "pending_prefill_tokens": 1000000}'
        async with router_for(stalled, busy, ready=2, first_byte_floor=0.3) as client:
            await eventually(lambda: client.post("/debug/route", json=BODY),
                             "the busy worker's queue in the router's books",
                             until=lambda r: queued_blocks(r.json(), busy) > 1000)
            answers = [await client.post("/v1/completions", json={
                **BODY, "prompt": f"r{i} " * 20, "stream": True}, timeout=60)
                for i in range(6)]
            assert [a.status_code for a in answers] == [200] * 6
            assert {a.headers["x-kvroute-worker"] for a in answers} == {busy.url}
            assert all(sse_events(a.content)[-1] == "[DONE]" for a in answers)
            metrics = (await client.get("/metrics")).text
            assert counted(metrics, "kvroute_upstream_failures_total", 'cause="deadline"') == 6
            assert len(stalled.requests) == 6, "every request tried the stalled worker first"
            await eventually(stalled.cancelled.is_set, "the abandoned request cancelled")


async def test_a_worker_whose_health_probe_hangs_gives_up_its_waiting_requests() -> None:
    # A floor far above the test's bound: the hung health probe alone must free the request.
    async with (
        ScriptedWorker() as paused,
        ScriptedWorker() as good,
        router_for(paused, good, ready=2, first_byte_floor=60) as client,
    ):
        paused.pause()  # its probe ends at the default health timeout: it never answers
        sends = [client.post("/v1/completions", json={**BODY, "prompt": f"p{i} " * 20},
                             timeout=60) for i in range(6)]
        answers = await asyncio.gather(*sends)
        assert [a.status_code for a in answers] == [200] * 6
        assert {a.headers["x-kvroute-worker"] for a in answers} == {good.url}
        assert (await described(client, paused))["state"] == "unhealthy"
