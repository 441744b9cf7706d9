"""A shared prefix is routed to its holder, and the worker confirms the prediction."""

from __future__ import annotations

from typing import Any

from e2e.harness import NOT_YET
from tests.support.eventually import eventually_blocking

SYSTEM = "You are a careful assistant. Answer briefly and cite the source. " * 8  # 520 bytes


def test_follow_up_goes_to_the_holder_and_cached_tokens_match(cluster: Any) -> None:
    router, _workers = cluster(workers=3)
    first = router.complete(SYSTEM + "Question one?")
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvroute-worker"]
    # the holder's events reach the router: its index has the prompt's full blocks
    prompt_blocks = len((SYSTEM + "Question one?").encode()) // 32
    eventually_blocking(lambda: next(w for w in router.workers() if w["url"] == holder)
                        ["blocks"]["device"] >= prompt_blocks,
                        "the holder's blocks in the router's index", tolerate=NOT_YET)
    follow = router.complete(SYSTEM + "Question two, a different one?")
    assert follow.status_code == 200
    assert follow.headers["x-kvroute-worker"] == holder
    predicted = int(follow.headers["x-kvroute-matched-blocks"]) * 32
    cached = follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert predicted == cached == (len(SYSTEM.encode()) // 32) * 32


def test_salted_requests_never_match_each_other(cluster: Any) -> None:
    router, _ = cluster(workers=2)
    a = router.complete(SYSTEM + "salted", cache_salt="tenant-a")
    assert a.status_code == 200
    eventually_blocking(lambda: sum(w["blocks"]["device"] for w in router.workers()) > 0,
                        "blocks indexed", tolerate=NOT_YET)
    b = router.complete(SYSTEM + "salted", cache_salt="tenant-b")
    assert b.headers["x-kvroute-matched-blocks"] == "0"
    assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = router.complete(SYSTEM + "salted!", cache_salt="tenant-a")
    assert again.headers["x-kvroute-worker"] == a.headers["x-kvroute-worker"]
    assert int(again.headers["x-kvroute-matched-blocks"]) > 0


def test_a_lora_adapter_is_its_own_scope(cluster: Any) -> None:
    router, _ = cluster(workers=2, worker_settings={"loras": "sql-adapter"})
    models = router.client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["kvroute-sim", "sql-adapter"]
    body = {"model": "sql-adapter", "prompt": SYSTEM + "lora", "max_tokens": 2}
    first = router.client.post("/v1/completions", json=body)
    assert first.status_code == 200
    eventually_blocking(lambda: sum(w["blocks"]["device"] for w in router.workers()) > 0, "indexed",
                        tolerate=NOT_YET)
    again = router.client.post("/v1/completions", json={**body, "prompt": SYSTEM + "lora 2"})
    assert again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    matched = int(again.headers["x-kvroute-matched-blocks"])
    assert matched * 32 == again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    base = router.client.post("/v1/completions", json={**body, "model": "kvroute-sim"})
    assert base.headers["x-kvroute-matched-blocks"] == "0", "the base model shares nothing"


def _gauge(router: Any, name: str) -> float:
    text = router.client.get("/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def test_the_eviction_pressure_and_the_rate_factor_are_in_the_metrics(cluster: Any) -> None:
    # Two workers of 64 blocks each (4,096 tokens of KV together); twelve distinct 1,000-byte
    # prompts need 372 blocks, so the caches evict and say so in their events. Each first
    # token teaches the workers' rate factor (shared by their engine kind), from 1.
    router, _ = cluster(workers=2, worker_settings={"num_blocks": 64, "speedup": 50})
    assert _gauge(router, "kvroute_eviction_pressure") == 0.0
    assert _gauge(router, "kvroute_rate_factor") == 1.0
    for i in range(12):
        assert router.complete(f"{i:04d} " + "distinct prompt text " * 47).status_code == 200
    eventually_blocking(lambda: _gauge(router, "kvroute_eviction_pressure") >= 0.5,
                        "the removals to reach the router", tolerate=NOT_YET)
    fixed, _ = cluster(workers=1, router_settings={"rates": "prefill=2e-6"})
    for i in range(12):
        assert fixed.complete(f"{i:04d} " + "distinct prompt text " * 47).status_code == 200
    assert _gauge(fixed, "kvroute_rate_factor") == 1.0  # rates set by hand are not learned


def test_a_chat_stays_with_its_session_and_the_router_counts_it(cluster: Any) -> None:
    router, _ = cluster(workers=2)
    turn = SYSTEM + "Question one?"
    first = router.complete(turn)
    assert first.status_code == 200
    holder = first.headers["x-kvroute-worker"]
    holder_id = first.headers["x-kvroute-worker-id"]
    for follow in (" Answer one. Question two?", " Answer two. Question three?"):
        turn += follow  # each turn sends the conversation so far
        again = router.complete(turn)
        assert again.status_code == 200 and again.headers["x-kvroute-worker"] == holder
    assert _gauge(router, "kvroute_session_continue_rate") == 1.0
    assert _gauge(router, f'kvroute_sessions{{worker="{holder_id}"}}') == 1.0
    body = {"model": "kvroute-sim", "prompt": turn + " Question four?", "max_tokens": 2}
    debug = router.client.post("/debug/route", json=body).json()
    assert debug["continues_session_on"] == next(
        w["id"] for w in router.workers() if w["url"] == holder)
    # Sessions off (through the environment): no session is tracked or shown.
    off, _ = cluster(workers=1, router_settings={"sessions": "off"})
    assert off.complete(turn).status_code == 200
    assert off.client.post("/debug/route", json=body).json()["continues_session_on"] is None
    assert "kvroute_sessions" not in off.client.get("/metrics").text
