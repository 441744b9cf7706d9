"""The router's view of a worker stays exact through resets, lost events, and restarts."""

from __future__ import annotations

import time
from typing import Any

import httpx

from e2e.harness import NOT_YET, Process, Router
from tests.support.eventually import eventually_blocking

PROMPTS = [f"document {i}: " + "lorem ipsum dolor sit amet " * 12 for i in range(6)]


def fill(router: Router, prompts: list[str]) -> None:
    for p in prompts:
        r = router.complete(p)
        assert r.status_code == 200, r.text


def test_reset_empties_the_routers_view(cluster: Any) -> None:
    router, workers = cluster(workers=2)
    fill(router, PROMPTS)
    eventually_blocking(lambda: all(router.indexed(w) == w.resident() for w in workers), "in sync",
                        tolerate=NOT_YET)
    target = max(workers, key=lambda w: len(w.resident()))
    assert router.indexed(target), "the worker holds blocks before the reset"
    reset_at = time.monotonic()
    r = httpx.post(f"{target.url}/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}
    eventually_blocking(lambda: router.indexed(target) == {}, "the router's view emptied",
                        tolerate=NOT_YET)
    took = time.monotonic() - reset_at
    print(f"reset -> router view empty in {took * 1000:.0f} ms")
    assert target.resident() == {}


def test_gap_is_replayed_and_a_larger_gap_resynced_by_snapshot(cluster: Any) -> None:
    router, workers = cluster(workers=1, worker_settings={"replay_buffer": 4})
    worker = workers[0]
    fill(router, PROMPTS[:2])
    eventually_blocking(lambda: router.indexed(worker) == worker.resident(), "in sync",
                        tolerate=NOT_YET)
    # a small gap: 2 batches withheld from the live socket, within the replay buffer
    httpx.post(f"{worker.url}/debug/drop_events", json={"batches": 2})
    fill(router, PROMPTS[2:4])
    eventually_blocking(lambda: router.indexed(worker) == worker.resident(), "in sync after replay",
                        tolerate=NOT_YET)
    counters = router.workers()[0]["counters"]
    # recovered by replay (a gap seen, or trailing loss found by the idle probe)
    assert counters.get("replayed", 0) >= 2 and counters.get("history_lost", 0) == 0
    # a large gap: more batches withheld than the buffer keeps -> snapshot resync
    httpx.post(f"{worker.url}/debug/drop_events", json={"batches": 20})
    fill(router, [f"fresh {i}: " + "consectetur adipiscing elit " * 10 for i in range(10)])
    started = time.monotonic()
    eventually_blocking(lambda: router.workers()[0]["counters"].get("snapshots", 0) >= 1,
                        "a snapshot resync", tolerate=NOT_YET)
    eventually_blocking(lambda: router.indexed(worker) == worker.resident(),
                        "in sync after snapshot", tolerate=NOT_YET)
    print(f"snapshot resync converged {time.monotonic() - started:.2f}s after the traffic; "
          f"blocks divergent: 0 of {len(worker.resident())}")


def test_a_restarted_router_rebuilds_its_index_and_routes_by_prefix(cluster: Any) -> None:
    router, workers = cluster(workers=3)
    fill(router, PROMPTS)
    holder = router.complete(PROMPTS[0] + " again").headers["x-kvroute-worker"]
    router.kill()
    router.start()
    router.wait_ready(3)
    eventually_blocking(lambda: all(router.indexed(w) == w.resident() for w in workers),
                        "index rebuilt from every worker's history", tolerate=NOT_YET)
    again = router.complete(PROMPTS[0] + " once more")
    assert again.headers["x-kvroute-worker"] == holder
    assert int(again.headers["x-kvroute-matched-blocks"]) >= len(PROMPTS[0]) // 32


def test_two_replicas_agree_on_where_a_prefix_lives(cluster: Any, processes: list[Process],
                                                     tmp_path: Any) -> None:
    router, workers = cluster(workers=3)
    second = Router("router-2", workers, tmp_path)
    processes.append(second)
    second.start()
    second.wait_ready(3)
    fill(router, PROMPTS[:3])
    for w in workers:
        eventually_blocking(lambda w=w: router.indexed(w) == second.indexed(w) == w.resident(),
                            "both replicas in sync", tolerate=NOT_YET)
    for p in PROMPTS[:3]:
        a = router.client.post("/debug/route", json={"prompt": p + " ?"}).json()
        b = second.client.post("/debug/route", json={"prompt": p + " ?"}).json()
        assert a["chosen"] == b["chosen"]
        assert max(x["matched_blocks"] for x in a["workers"]) == len(p) // 32
