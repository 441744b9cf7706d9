"""Load spreads a hot prefix and comes back; a killed worker costs no request that had not
started, ends streams in flight with an error event, and is re-learned when it returns."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from e2e.harness import NOT_YET, Router
from tests.support.eventually import eventually_blocking

HOT = "The shared system prompt of a busy agent fleet. " * 40  # 1,960 bytes: 61 blocks
#: Tokens each held stream asks for: minutes of decoding on the sim worker, never reached.
HELD_TOKENS = 60_000


def stream_completion(router: Router, prompt: str, max_tokens: int,
                      started: threading.Event | None = None) -> dict[str, Any]:
    """Stream one completion; returns the worker, the events, and whether it ended in error.
    ``started`` is set at the first event (the router booked the first token before)."""
    body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": max_tokens,
            "stream": True}
    events: list[Any] = []
    with httpx.Client(base_url=router.url, timeout=60) as client, \
            client.stream("POST", "/v1/completions", json=body) as r:
        worker = r.headers.get("x-kvroute-worker")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None:
                    started.set()
    return {"worker": worker, "events": events, "status": r.status_code,
            "error": any(isinstance(e, dict) and "error" in e for e in events)}


def held_stream(router: Router, prompt: str, started: threading.Event,
                release: threading.Event) -> dict[str, Any]:
    """Stream one long completion, set ``started`` at its first event (from then on the
    router books it as decoding), read it until ``release``, then leave; ``ended`` says
    whether it ended first (it must not: it asks for minutes of tokens)."""
    body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": HELD_TOKENS,
            "stream": True}
    first: Any = None
    ended = False
    with httpx.Client(base_url=router.url, timeout=60) as client, \
            client.stream("POST", "/v1/completions", json=body) as r:
        worker = r.headers.get("x-kvroute-worker")
        for line in r.iter_lines():  # leaving the loop closes the stream
            if line.startswith("data: ") and first is None:
                first = line[6:]
                started.set()
            ended = line == "data: [DONE]"
            if release.is_set() or ended:
                break
    started.set()  # also when it failed: the test then reports what came back
    return {"worker": worker, "status": r.status_code, "first": first, "ended": ended}


def in_flight(router: Router) -> list[int]:
    """Requests the router's books hold on each worker (its own decision's view)."""
    body = {"model": "kvroute-sim", "prompt": "probe", "max_tokens": 1}
    answer = router.client.post("/debug/route", json=body).json()
    return [w["active_requests"] for w in answer["workers"]]


def hot_prefix_held(router: Router, streams: int = 64) -> tuple[str, list[dict[str, Any]]]:
    """Warm one worker with the hot prefix, then start ``streams`` long completions over it
    one at a time, each once the one before decodes, all held open; returns the holder and
    the results (after releasing them)."""
    first = router.complete(HOT + "warm up")
    holder = first.headers["x-kvroute-worker"]
    eventually_blocking(lambda: next(w for w in router.workers() if w["url"] == holder)
                        ["blocks"]["device"] >= len(HOT) // 32, "the hot prefix indexed",
                        tolerate=NOT_YET)
    release = threading.Event()
    with ThreadPoolExecutor(streams) as pool:
        futures = []
        try:
            for i in range(streams):
                started = threading.Event()
                futures.append(pool.submit(held_stream, router, HOT + f"q{i}", started,
                                           release))
                assert started.wait(30), f"stream {i} began"
            assert sum(in_flight(router)) == streams, "every stream is still held"
        finally:
            release.set()
        results = [f.result(60) for f in futures]
    assert all(r["status"] == 200 and "choices" in json.loads(r["first"]) for r in results)
    assert not any(r["ended"] for r in results), "a held stream ended by itself"
    return holder, results


def test_a_hot_prefix_spreads_under_load_and_returns_when_load_falls(cluster: Any) -> None:
    # Each of the 64 streams holds the prefix's 61 blocks while it decodes. The rates are set
    # by hand (no learning) with a token of decode context at 1/32 of a token of prefill, so
    # the holder's predicted wait (decode_s x blocks decoding there) passes the 62 blocks a
    # cold worker would prefill once about 32 streams run there. The load is the router's
    # own books, made exact: each stream is sent once the one before has its first token (so
    # it is booked as decoding), and none ends before the last is sent (each asks for far
    # more tokens than the test takes), so no decision depends on how fast the machine is.
    # Peer fetch is off: with it the idle workers copy the prefix instead of recomputing it,
    # which is cheaper than the 62 blocks' prefill these weights count
    # (e2e/test_router_peer_fetch.py tests that choice).
    router, _ = cluster(workers=3, router_settings={"rates": "prefill=0.001,decode=0.00003125",
                                                    "kv_fetch": "off"})
    holder, results = hot_prefix_held(router)
    used = {r["worker"] for r in results}
    counts = sorted((sum(r["worker"] == u for r in results) for u in used), reverse=True)
    print(f"64 concurrent hot-prefix requests spread over {len(used)} workers: {counts}")
    assert len(used) >= 2, "load on the holder outweighed its cache"
    assert counts[0] <= 48, "no pile-up on one worker"
    on_holder = sum(r["worker"] == holder for r in results)
    assert 24 <= on_holder <= 40, "the holder took the first ones, about the 32 the weights say"
    assert [r["worker"] for r in results[:24]] == [holder] * 24
    # load has fallen (the streams left): the prefix goes to a worker holding all of it again
    eventually_blocking(lambda: in_flight(router) == [0, 0, 0], "the streams' bookings gone",
                        tolerate=NOT_YET)
    after = router.complete(HOT + "after the burst")
    assert int(after.headers["x-kvroute-matched-blocks"]) == len(HOT) // 32
    assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        (len(HOT) // 32) * 32


def test_kill_9_of_a_worker_under_load(cluster: Any) -> None:
    router, workers = cluster(workers=3)
    first = router.complete(HOT + "warm up")
    victim = next(w for w in workers if w.url == first.headers["x-kvroute-worker"])
    eventually_blocking(lambda: len(router.indexed(victim)) >= len(HOT) // 32, "victim indexed",
                        tolerate=NOT_YET)
    with ThreadPoolExecutor(4) as pool:
        in_flight = [pool.submit(stream_completion, router, HOT + f"long {i}", 400)
                     for i in range(4)]
        eventually_blocking(lambda: victim.alive()
                            and httpx.get(f"{victim.url}/load").json()["running"] >= 2,
                            "streams running on the victim", tolerate=NOT_YET)
        victim.kill()  # SIGKILL
        killed_at = time.monotonic()
        streams = [f.result(60) for f in in_flight]
    on_victim = [s for s in streams if s["worker"] == victim.url]
    assert on_victim, "some streams were on the victim"
    for s in on_victim:
        assert s["error"] and s["events"][-1] == "[DONE]", "ended with an error event"
    # requests not yet started succeed elsewhere
    after = [router.complete(HOT + f"after {i}") for i in range(6)]
    assert [a.status_code for a in after] == [200] * 6
    assert all(a.headers["x-kvroute-worker"] != victim.url for a in after)
    eventually_blocking(lambda: router.indexed(victim) == {}, "the dead worker's entries gone",
                        tolerate=NOT_YET)
    gone_after = time.monotonic() - killed_at
    # it comes back as a new instance on the same address: learned from scratch
    victim.start()
    victim.wait_healthy()
    eventually_blocking(lambda: next(w for w in router.workers() if w["url"] == victim.url)
                        ["state"] == "healthy", "the victim back in the candidate set",
                        tolerate=NOT_YET)
    described = next(w for w in router.workers() if w["url"] == victim.url)
    assert described["counters"].get("restarts", 0) + 1 >= 1
    assert router.indexed(victim) == victim.resident() == {}
    print(f"kill -9: {len(on_victim)} streams ended with an error event, 0 of 6 later "
          f"requests failed, entries dropped {gone_after:.2f}s after the kill")


def test_requests_keep_flowing_while_a_worker_dies(cluster: Any) -> None:
    router, workers = cluster(workers=2)
    failures: list[int] = []
    done = [0]
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set() and done[0] < 1000:
            r = router.complete(f"steady {done[0] % 7} " * 30)
            if r.status_code != 200:
                failures.append(r.status_code)
            done[0] += 1

    thread = threading.Thread(target=traffic)
    thread.start()
    eventually_blocking(lambda: done[0] >= 20, "traffic before the fault", 20, tolerate=NOT_YET)
    workers[1].kill()
    at_kill = done[0]
    eventually_blocking(lambda: done[0] >= at_kill + 50, "traffic after the fault", 30,
                        tolerate=NOT_YET)
    stop.set()
    thread.join(30)
    assert failures == [], f"requests failed: {failures}"
    print(f"steady traffic: {done[0]} requests, {len(failures)} failed across a kill -9")
