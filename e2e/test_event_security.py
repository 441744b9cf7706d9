"""A cluster with CURVE on its event plane and a keyed salt tag routes as one without; a router
without the keys learns nothing from the workers' events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from e2e.harness import NOT_YET, Process, Router
from kvroute.keys import generate_keypair
from tests.support.eventually import eventually_blocking

SYSTEM = "You are a careful assistant. Answer briefly and cite the source. " * 8  # 520 bytes


def test_a_secured_cluster_routes_by_prefix_and_an_outsider_learns_nothing(
        cluster: Any, processes: list[Process], tmp_path: Path) -> None:
    worker_pub, worker_secret = generate_keypair(tmp_path / "workers", "workers")
    _, router_secret = generate_keypair(tmp_path / "routers", "router")
    _, outsider_secret = generate_keypair(tmp_path / "outsiders", "outsider")
    router, workers = cluster(
        workers=2,
        worker_settings={"curve_secret_key": worker_secret,
                         "curve_authorized_clients": tmp_path / "routers",
                         "salt_secret": "cluster-secret"},
        router_settings={"curve_secret_key": router_secret, "curve_server_key": worker_pub,
                         "salt_secret": "cluster-secret"})
    outsider = Router("outsider", workers, tmp_path, curve_secret_key=outsider_secret,
                      curve_server_key=worker_pub, salt_secret="cluster-secret")
    processes.append(outsider)
    outsider.start()
    outsider.wait_ready(2)

    first = router.complete(SYSTEM + "salted", cache_salt="tenant-a")
    assert first.status_code == 200, first.text
    holder = next(w for w in workers if w.url == first.headers["x-kvroute-worker"])
    blocks = len((SYSTEM + "salted").encode()) // 32
    eventually_blocking(lambda: len(router.indexed(holder)) >= blocks,
                        "the holder's blocks indexed", tolerate=NOT_YET)
    again = router.complete(SYSTEM + "salted again", cache_salt="tenant-a")
    assert again.headers["x-kvroute-worker"] == holder.url
    predicted = int(again.headers["x-kvroute-matched-blocks"]) * 32
    assert predicted == again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = router.complete(SYSTEM + "salted", cache_salt="tenant-b")
    assert other.headers["x-kvroute-matched-blocks"] == "0"
    # The outsider's key is not among the workers' authorized clients: its index stays empty
    # while the authorized router's holds the blocks.
    assert all(len(outsider.indexed(w)) == 0 for w in workers)
