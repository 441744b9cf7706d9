"""Disaggregated serving with kvroute's sim workers: one prefill worker, one decode worker.

The router prefills each request on the prefill worker (``max_tokens`` 1, vLLM's
``kv_transfer_params``), then sends it to the decode worker with the prefill's params; the
decode worker takes the KV by a simulated transfer and publishes the blocks it received, so
the router's index learns of them from the receiver. A decode worker that already holds most
of a prompt prefills it locally; a dead prefill worker costs no request, nor does a dead decode
worker (the request goes to another with a fresh prefill). A prefill worker holds a prefill's
blocks until its decode worker says it took them, or until a lease ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from e2e.harness import NOT_YET, Process, Router, Worker, metric
from tests.support.eventually import eventually_blocking

SYSTEM = "Prefill here, decode there, and the answer is the same either way. " * 10
SIM = {"speedup": 20}



def _start(tmp_path: Path, processes: list[Process], **prefill_settings: Any
           ) -> tuple[Router, Worker, Worker]:
    prefill = Worker(0, tmp_path, **SIM, **prefill_settings)
    decode = Worker(1, tmp_path, **SIM)
    for w in (prefill, decode):
        w.start()
        processes.append(w)
    for w in (prefill, decode):
        w.wait_healthy()
    router = Router("router", [], tmp_path,
                    specs=[f"{prefill.url},role=prefill", f"{decode.url},role=decode"])
    router.start()
    processes.append(router)
    router.wait_ready(2)
    return router, prefill, decode


def test_prefill_there_decode_here_with_the_same_output(tmp_path: Path,
                                                        processes: list[Process]) -> None:
    router, prefill, decode = _start(tmp_path, processes)
    alone = Worker(2, tmp_path, **SIM)  # aggregated serving, for the reference output
    alone.start()
    processes.append(alone)
    alone.wait_healthy()
    workers = {w["url"]: w for w in router.workers()}
    assert (workers[prefill.url]["role"], workers[decode.url]["role"]) == ("prefill", "decode")

    prompt = SYSTEM + "What moved?"
    plan = router.client.post("/debug/route", json={"model": "kvroute-sim", "prompt": prompt})
    assert (plan.json()["chosen"], plan.json()["prefill"]) == (decode.url, prefill.url)
    answer = router.complete(prompt, max_tokens=8)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-worker"] == decode.url
    reference = httpx.post(f"{alone.url}/v1/completions", timeout=30, json={
        "model": "kvroute-sim", "prompt": prompt, "max_tokens": 8}).json()
    assert answer.json()["choices"][0]["text"] == reference["choices"][0]["text"]

    # Every full block but the last came by transfer, and the decode worker served them
    # from its cache.
    blocks = (len(prompt.encode()) - 1) // 32
    decode_metrics = httpx.get(f"{decode.url}/metrics").text
    assert metric(decode_metrics, "kvroute_worker_transferred_tokens_total") == blocks * 32
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 32
    # The decode worker's events of the received blocks reach the router's index.
    eventually_blocking(lambda: len(router.indexed(decode)) >= blocks,
                        "the received blocks in the decode worker's index entries",
                        tolerate=NOT_YET)
    assert len(router.indexed(prefill)) >= blocks
    assert metric(router.client.get("/metrics").text,
                  "kvroute_pd_prefills_total", outcome="remote") == 1

    # A follow-up the decode worker holds nearly all of is prefilled there, no transfer.
    follow = router.complete(prompt + " And then?", max_tokens=4)
    assert follow.status_code == 200 and follow.headers["x-kvroute-worker"] == decode.url
    assert metric(httpx.get(f"{decode.url}/metrics").text,
                  "kvroute_worker_transferred_tokens_total") == blocks * 32
    assert metric(router.client.get("/metrics").text,
                  "kvroute_pd_prefills_total", outcome="local") == 1


def test_a_failed_or_dead_prefill_worker_costs_no_request(tmp_path: Path,
                                                          processes: list[Process]) -> None:
    # The prefill worker refuses prompts over 128 tokens: the router serves them whole on
    # the decode worker.
    router, prefill, decode = _start(tmp_path, processes, max_model_len=128)
    answer = router.complete(SYSTEM, max_tokens=4)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-worker"] == decode.url
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    metrics = router.client.get("/metrics").text
    assert metric(metrics, "kvroute_pd_prefills_total", outcome="failed") == 1
    assert metric(metrics, "kvroute_pd_prefills_total", outcome="remote") == 0
    prefill.kill()
    for i in range(4):  # before and after the health poll notices
        answer = router.complete(f"{i} " + SYSTEM, max_tokens=4)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvroute-worker"] == decode.url
    metrics = router.client.get("/metrics").text
    assert metric(metrics, "kvroute_pd_prefills_total", outcome="remote") == 0


def _kv_usage(worker: Worker) -> float:
    return httpx.get(f"{worker.url}/load", timeout=10).json()["kv_usage"]


def test_a_dead_decode_worker_hands_on_with_a_fresh_prefill(tmp_path: Path,
                                                            processes: list[Process]) -> None:
    # The prefill worker's lease is long (30 s here), so a hold it lets go of was released
    # by the decode worker that took it. The router's health poll is slow, so a decode worker
    # that died is still a candidate when the next request comes.
    prefill = Worker(0, tmp_path, **SIM, kv_lease_seconds=600)
    decodes = [Worker(i, tmp_path, **SIM) for i in (1, 2)]
    for w in (prefill, *decodes):
        w.start()
        processes.append(w)
    for w in (prefill, *decodes):
        w.wait_healthy()
    router = Router("router", [], tmp_path, health_interval=60, unhealthy_grace=120,
                    specs=[f"{prefill.url},role=prefill",
                           *(f"{d.url},role=decode" for d in decodes)])
    router.start()
    processes.append(router)
    router.wait_ready(3)

    first = router.complete(SYSTEM, max_tokens=4)
    assert first.status_code == 200, first.text
    holder = next(d for d in decodes if d.url == first.headers["x-kvroute-worker"])
    other = next(d for d in decodes if d is not holder)
    assert _kv_usage(prefill) == 0  # the decode worker took the KV and said so
    blocks = (len(SYSTEM.encode()) - 1) // 32
    eventually_blocking(lambda: len(router.indexed(holder)) >= blocks,
                        "the received blocks in the holder's index entries", tolerate=NOT_YET)

    # The follow-up's decode worker is the one holding its history, which is now dead: the
    # request goes to the other with a prefill of its own.
    holder.kill()
    follow = router.complete(SYSTEM + " And now a question long enough to be prefilled "
                             "elsewhere: " + "why? " * 80, max_tokens=4)
    assert follow.status_code == 200, follow.text
    assert follow.headers["x-kvroute-worker"] == other.url
    metrics = router.client.get("/metrics").text
    assert metric(metrics, "kvroute_pd_prefills_total", outcome="retried") == 1
    assert metric(metrics, "kvroute_pd_prefills_total", outcome="remote") == 3
    assert metric(httpx.get(f"{other.url}/metrics").text,
                  "kvroute_worker_transferred_tokens_total") > 0
    # The prefill made for the dead worker is never taken: it stays held, until its lease ends.
    assert _kv_usage(prefill) > 0


def test_a_prefill_whose_decode_never_comes_is_released_when_its_lease_ends(
        tmp_path: Path, processes: list[Process]) -> None:
    prefill = Worker(0, tmp_path, **SIM, kv_lease_seconds=20)  # 1 s at this speedup
    prefill.start()
    processes.append(prefill)
    prefill.wait_healthy()
    answer = httpx.post(f"{prefill.url}/v1/completions", timeout=30, json={
        "model": "kvroute-sim", "prompt": SYSTEM, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    assert answer.status_code == 200, answer.text
    lease = answer.json()["kv_transfer_params"]["remote_request_id"]  # its blocks are held
    eventually_blocking(lambda: _kv_usage(prefill) == 0, "the lease ended", timeout=30)
    released = httpx.post(f"{prefill.url}/kv_transfer/release",
                          json={"remote_request_id": lease}, timeout=10)
    assert released.json() == {"released": False}  # nothing left to release
    bad = httpx.post(f"{prefill.url}/kv_transfer/release", json={"lease": 1}, timeout=10)
    assert bad.status_code == 400 and "remote_request_id" in bad.text
