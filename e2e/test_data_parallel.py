"""One worker of two data-parallel ranks behind the router: each rank is a cache of its own.

The worker (``kvroute worker --data-parallel-size 2``) runs two sim engines behind one port and
publishes both ranks' events on one stream; the router indexes them as two candidates and pins
the chosen one with ``X-data-parallel-rank``.
"""

from __future__ import annotations

from typing import Any

import httpx

from e2e.harness import NOT_YET, ranks_served
from tests.support.eventually import eventually_blocking

SYSTEM = "Every rank keeps a cache of its own; route to the one that holds it. " * 8


def _ranks(router: Any) -> list[dict[str, Any]]:
    (worker,) = router.workers()
    return worker["ranks"]  # type: ignore[no-any-return]


def test_ranks_are_candidates_of_their_own(cluster: Any) -> None:
    router, (worker,) = cluster(workers=1, worker_settings={"data_parallel_size": 2})
    info = router.workers()[0]
    assert info["dp_size"] == 2 and [r["rank"] for r in info["ranks"]] == [0, 1]
    assert httpx.get(f"{worker.url}/model_info").json()["data_parallel_size"] == 2

    first = router.complete(SYSTEM + "first question?")
    assert first.status_code == 200, first.text
    rank = int(first.headers["x-kvroute-worker-rank"])
    holder_id = int(first.headers["x-kvroute-worker-id"])
    blocks = len((SYSTEM + "first question?").encode()) // 32
    # The rank's events reach the router under the rank's own id; the other rank holds none.
    eventually_blocking(lambda: _ranks(router)[rank]["blocks"]["device"] >= blocks,
                        "the serving rank's blocks in the index", tolerate=NOT_YET)
    assert _ranks(router)[1 - rank]["blocks"]["device"] == 0
    assert _ranks(router)[rank]["id"] == holder_id
    held = router.client.get(f"/debug/index/{holder_id}").json()["blocks"]
    assert len(held) >= blocks

    # A repeat goes to the same rank, and that rank's cache serves it.
    again = router.complete(SYSTEM + "first question, asked again?")
    assert again.headers["x-kvroute-worker-rank"] == str(rank)
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == int(again.headers["x-kvroute-matched-blocks"]) * 32 > 0

    # Prompts sharing nothing spread over both ranks.
    assert ranks_served(rank, lambda i: router.complete(
        f"{i:03d} an unrelated prompt about something else " * 6)) == {0, 1}
    eventually_blocking(lambda: all(r["blocks"]["device"] > 0 for r in _ranks(router)),
                        "both ranks indexed", tolerate=NOT_YET)


def test_the_worker_serves_the_pinned_rank_and_refuses_one_it_lacks(cluster: Any) -> None:
    _router, (worker,) = cluster(workers=1, worker_settings={"data_parallel_size": 2})
    body = {"model": "kvroute-sim", "prompt": SYSTEM + "pinned", "max_tokens": 2}
    for _ in range(2):  # the second is a full hit only on the rank that served the first
        answer = httpx.post(f"{worker.url}/v1/completions", json=body,
                            headers={"X-data-parallel-rank": "1"}, timeout=30)
        assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = httpx.post(f"{worker.url}/v1/completions", json=body,
                       headers={"X-data-parallel-rank": "0"}, timeout=30)
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    bad = httpx.post(f"{worker.url}/v1/completions", json=body,
                     headers={"X-data-parallel-rank": "2"}, timeout=30)
    assert bad.status_code == 400 and "0..1" in bad.json()["error"]["message"]
