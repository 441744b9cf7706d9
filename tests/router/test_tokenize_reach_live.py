"""``--tokenize match`` against a real worker on 127.0.0.1 (its events over ZeroMQ): the
blocks the router expects cached are exactly those the worker reports cached, turn after
turn, although the router tokenizes only as far as the match."""

from __future__ import annotations

from pathlib import Path

import httpx

from router.http.app import create_app as create_router
from router.settings import RouterSettings
from tests.fixtures.tokenizer_files import write_tiny_tokenizer
from tests.router.test_router_service import wait_ready
from tests.support.eventually import eventually
from tests.support.servers import UvicornServer
from workers.http.api import create_app as create_worker
from workers.settings import WorkerSettings

DOCUMENT = " ".join(f"the router holds block {i} of the cached document" for i in range(400))


async def test_the_router_expects_exactly_what_the_worker_caches(tmp_path: Path) -> None:
    folder = str(write_tiny_tokenizer(tmp_path).parent)
    worker = create_worker(WorkerSettings(events_port=0, replay_port=0, speedup=1e6,
                                          tokenizer=folder, block_size=16))
    async with UvicornServer(worker) as w:
        router = create_router(RouterSettings(workers=(w.url,), tokenizer=folder,
                                              block_size=16, health_interval=0.1, seed=3))
        async with UvicornServer(router) as r, httpx.AsyncClient(base_url=r.url,
                                                                 timeout=30) as client:
            await wait_ready(client, 1)
            messages = [{"role": "user", "content": DOCUMENT}]
            for turn in range(3):
                body = {"model": "kvroute-sim", "messages": messages, "max_tokens": 4}
                answer = await client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                expected = int(answer.headers["x-kvroute-matched-blocks"]) * 16
                cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert expected == cached, f"turn {turn}"
                if turn:  # every earlier turn is cached, and the router knew it
                    assert cached > len(DOCUMENT) // 8
                prompt = answer.json()["usage"]["prompt_tokens"]

                async def indexed(blocks: int = prompt // 16) -> bool:  # the worker's events
                    metrics = (await client.get("/metrics")).text
                    line = next(x for x in metrics.splitlines()
                                if x.startswith("kvroute_index_blocks "))
                    return float(line.split()[1]) >= blocks

                await eventually(indexed, "the worker's events at the router")
                messages = [*messages, {"role": "assistant", "content": "noted"},
                            {"role": "user", "content": f"and block {turn}?"}]
            # The router's own ids equal the worker's.
            async with httpx.AsyncClient(base_url=w.url) as direct:
                theirs = (await direct.post("/tokenize", json={"model": "kvroute-sim",
                                                               "messages": messages})).json()
            ours = (await client.post("/tokenize", json={"model": "kvroute-sim",
                                                         "messages": messages})).json()
            assert ours["tokens"] == theirs["tokens"]
