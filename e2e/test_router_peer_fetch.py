"""Peer KV fetch through the router, on real processes: a router and two sim workers on
127.0.0.1 sharing the transfer secret. The worker holding a long prefix is kept busy by a
client of its own (foreign load the router reads from its ``/load``); the router then sends
the prefix's next request to the idle worker with a fetch instruction, the idle worker pulls
the blocks from the busy one by key, serves the request from them and says so in its
answer, and the router counts the fetch and learns the pair's link."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from e2e.harness import Process, Router, Worker, metric
from tests.support.eventually import eventually_blocking

SECRET = "e2e-router-fetch-secret-0123456789"
#: 24,000 one-byte tokens: 750 blocks of 32, dearer to recompute than to fetch.
PREFIX = "".join(f"Clause {i}: the tenant keeps the premises in good order. " for i in range(420))
PROMPT = PREFIX[:24000]
#: What keeps the holder busy: a cold prompt of 150,000 tokens, several seconds of prefill.
BUSY = "".join(f"Unrelated document line {i}, nothing shared. " for i in range(4000))[:150000]


def test_a_busy_holders_prefix_is_fetched_by_the_idle_worker(tmp_path: Path,
                                                             processes: list[Process]) -> None:
    secret = tmp_path / "transfer-secret"
    secret.write_text(SECRET + "\n")
    settings = {"max_model_len": 200000, "num_blocks": 12000}
    workers = [Worker(i, tmp_path, **settings) for i in range(2)]
    for w in workers:
        w.env["KVROUTE_KV_TRANSFER_SECRET_FILE"] = str(secret)
        w.start()
        processes.append(w)
    for w in workers:
        w.wait_healthy(timeout=60)
    router = Router("router", workers, tmp_path, kv_transfer_secret_file=secret)
    router.start()
    processes.append(router)
    router.wait_ready(2, timeout=60)

    first = router.complete(PROMPT, max_tokens=1)
    assert first.status_code == 200, first.text
    holder = next(w for w in workers if w.url == first.headers["x-kvroute-worker"])
    taker = next(w for w in workers if w is not holder)
    eventually_blocking(lambda: len(router.indexed(holder)) >= 700,
                        "the prefix's blocks indexed on the holder", 30)

    # The holder's own client: a long cold prompt, streamed, sent past the router.
    def busy() -> None:
        with httpx.stream("POST", f"{holder.url}/v1/completions", timeout=120,
                          json={"prompt": BUSY, "max_tokens": 64, "stream": True}) as r:
            for _ in r.iter_bytes():
                pass
    thread = threading.Thread(target=busy, daemon=True)
    thread.start()

    body = {"model": "kvroute-sim", "prompt": PROMPT, "max_tokens": 4}

    def fetch_chosen() -> bool:
        decision = router.client.post("/debug/route", json=body).json()
        return decision.get("fetch_source") == holder.url
    eventually_blocking(fetch_chosen, "the router pricing a fetch from the busy holder", 30)

    answer = router.complete(PROMPT, max_tokens=4)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-worker"] == taker.url
    assert answer.headers["x-kvroute-fetch-source"] == holder.url
    result = answer.headers["x-kvroute-fetch-result"]
    assert result.startswith("blocks="), result
    fetched = int(result.split(";")[0].split("=")[1])
    assert fetched >= 700
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= fetched * 32

    text = router.client.get("/metrics").text
    assert metric(text, "kvroute_fetch_results_total", outcome="fetched") == 1
    assert metric(text, "kvroute_fetch_bytes_total") > 0
    assert metric(httpx.get(f"{holder.url}/metrics").text, "kvroute_worker_kv_reads_total",
                  outcome="served") == 1
    # The taker's events tell the router it holds the prefix now.
    eventually_blocking(lambda: len(router.indexed(taker)) >= fetched,
                        "the fetched blocks indexed on the taker", 30)
    thread.join(timeout=120)


def test_a_remote_prefill_is_taken_and_released_with_the_shared_secret(
        tmp_path: Path, processes: list[Process]) -> None:
    """With the secret, a decode worker pulls and releases the prefill worker's KV only for a
    request the router vouches for: the router's token goes on the decode leg, so the
    prefill worker's hold ends at once instead of at its lease's end."""
    secret = tmp_path / "transfer-secret"
    secret.write_text(SECRET + "\n")
    prefill = Worker(0, tmp_path, speedup=20, kv_lease_seconds=600)
    decode = Worker(1, tmp_path, speedup=20)
    for w in (prefill, decode):
        w.env["KVROUTE_KV_TRANSFER_SECRET_FILE"] = str(secret)
        w.start()
        processes.append(w)
    for w in (prefill, decode):
        w.wait_healthy(timeout=60)
    router = Router("router", [], tmp_path, kv_transfer_secret_file=secret,
                    specs=[f"{prefill.url},role=prefill", f"{decode.url},role=decode"])
    router.start()
    processes.append(router)
    router.wait_ready(2, timeout=60)

    answer = router.complete(PROMPT[:4000], max_tokens=4)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-worker"] == decode.url
    assert metric(router.client.get("/metrics").text, "kvroute_pd_prefills_total",
                  outcome="remote") == 1
    assert httpx.get(f"{prefill.url}/load", timeout=10).json()["kv_usage"] == 0
