"""Disaggregated serving with kvroute's torch workers on the CPU: the KV really moves.

Two prefill workers and one decode worker (the ``tiny`` decoder, CPU) behind the router. The
router prefills a request on a prefill worker; the decode worker pulls that worker's held
blocks (``GET /kv_transfer/blocks/...``), writes them into its own cache, publishes them, and
decodes: its greedy tokens equal those of one worker that computed the whole prompt, and its
counters show the prompt came by transfer, not computed. A follow-up with a long new part is
prefilled on the prefill worker that holds its prefix.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from e2e.harness import NOT_YET, Process, Router, Worker, metric
from tests.support.eventually import eventually_blocking
from tests.support.lazy import require

require("torch")

TORCH = {"engine": "torch", "torch_model": "tiny", "device": "cpu", "kv_memory_gb": 0.05}
SYSTEM = "Prefill there, decode here, and the tokens are the same either way. " * 10



def _requests(worker: Worker) -> float:
    return metric(httpx.get(f"{worker.url}/metrics", timeout=10).text,
                  "kvroute_worker_requests_total")


def test_torch_prefill_and_decode_give_one_workers_tokens(tmp_path: Path,
                                                          processes: list[Process]) -> None:
    prefills = [Worker(i, tmp_path, **TORCH) for i in (0, 1)]
    decode, alone = Worker(2, tmp_path, **TORCH), Worker(3, tmp_path, **TORCH)
    for w in (*prefills, decode, alone):
        w.start()
        processes.append(w)
    for w in (*prefills, decode, alone):
        w.wait_healthy(timeout=120)
    router = Router("router", [], tmp_path,
                    specs=[*(f"{p.url},role=prefill" for p in prefills),
                           f"{decode.url},role=decode"])
    router.start()
    processes.append(router)
    router.wait_ready(3)

    prompt = SYSTEM + "What moved?"
    answer = router.complete(prompt, max_tokens=8)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-worker"] == decode.url
    reference = httpx.post(f"{alone.url}/v1/completions", timeout=60, json={
        "model": "kvroute-sim", "prompt": prompt, "max_tokens": 8}).json()
    assert answer.json()["choices"][0]["text"] == reference["choices"][0]["text"]

    # Every full block but the last came by transfer; none of them was computed here.
    blocks = len(prompt.encode()) // 32  # the BOS token makes the prompt one longer
    decode_metrics = httpx.get(f"{decode.url}/metrics", timeout=10).text
    assert metric(decode_metrics, "kvroute_worker_transferred_tokens_total") == blocks * 32
    assert metric(decode_metrics, "kvroute_worker_kv_transfer_failures_total") == 0
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 32
    holder = next(p for p in prefills if _requests(p) == 1)
    assert sum(_requests(p) for p in prefills) == 1
    # The decode worker took the KV and said so: the prefill worker holds nothing now.
    assert httpx.get(f"{holder.url}/load", timeout=10).json()["kv_usage"] == 0
    # The received blocks reach the router's index from the decode worker's events.
    eventually_blocking(lambda: len(router.indexed(decode)) >= blocks,
                        "the received blocks in the decode worker's index entries",
                        tolerate=NOT_YET)
    eventually_blocking(lambda: len(router.indexed(holder)) >= blocks,
                        "the prefill worker's blocks in the index", tolerate=NOT_YET)

    # A follow-up with a long new part is prefilled remotely, on the prefix holder.
    follow = prompt + " And now a question long enough to be prefilled elsewhere: " + \
        "why? " * 80
    plan = router.client.post("/debug/route", json={"model": "kvroute-sim", "prompt": follow})
    assert (plan.json()["chosen"], plan.json()["prefill"]) == (decode.url, holder.url)
    again = router.complete(follow, max_tokens=4)
    assert again.status_code == 200, again.text
    assert _requests(holder) == 2 and sum(_requests(p) for p in prefills) == 2
    reference = httpx.post(f"{alone.url}/v1/completions", timeout=60, json={
        "model": "kvroute-sim", "prompt": follow, "max_tokens": 4}).json()
    assert again.json()["choices"][0]["text"] == reference["choices"][0]["text"]
    follow_blocks = len(follow.encode()) // 32
    decode_metrics = httpx.get(f"{decode.url}/metrics", timeout=10).text
    # Only the blocks it did not hold count as transferred.
    assert metric(decode_metrics, "kvroute_worker_transferred_tokens_total") == \
        follow_blocks * 32
    assert metric(router.client.get("/metrics").text,
                  "kvroute_pd_prefills_total", outcome="remote") == 2
