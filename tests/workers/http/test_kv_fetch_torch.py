"""Peer KV fetch between two torch CPU worker apps in one process: the receiver reads the
holder's blocks by key, writes them into its cache, and decodes the same greedy tokens as a
worker that computed the prompt itself, whether it fetched the whole prefix or only the
blocks past its own hit; blocks of another shape are refused and the prompt computed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tests.support.lazy import require
from tests.workers.http.test_kv_pull import _settings
from workers.http.api import create_app
from workers.http.kv_fetch import HTTP_FETCH_BANDWIDTH
from workers.settings import WorkerSettings

require("torch")

PROMPT = "Fetch it from a peer, then decode here."  # 39 bytes + BOS: 10 full blocks of 4
FULL = (len(PROMPT.encode()) + 1 - 1) // 4
SOURCE = "http://127.0.0.1:8102"


@contextlib.asynccontextmanager
async def _worker(settings: WorkerSettings, peer: Any = None
                  ) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    if peer is not None:
        fetcher = app._state.fetcher  # type: ignore[attr-defined]
        await fetcher.http.aclose()
        fetcher.http = httpx.AsyncClient(transport=httpx.ASGITransport(peer))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://worker") as client:
        client.app = app  # type: ignore[attr-defined]
        yield client


async def _complete(client: httpx.AsyncClient, text: str, fetch: int | None = None
                    ) -> httpx.Response:
    headers = {} if fetch is None else {"x-kvroute-fetch-source": SOURCE,
                                        "x-kvroute-fetch-blocks": str(fetch)}
    answer = await client.post("/v1/completions", headers=headers,
                               json={"prompt": text, "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    return answer


def _cached(answer: httpx.Response) -> int:
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_the_receiver_decodes_the_same_tokens_from_fetched_blocks() -> None:
    # The reference computes the last block over its cached prefix, as the receiver does.
    async with _worker(_settings()) as alone:
        await _complete(alone, PROMPT)
        reference = (await _complete(alone, PROMPT)).json()["choices"][0]["text"]
    async with _worker(_settings()) as holder:
        await _complete(holder, PROMPT)
        layout = holder.app._state.runtime.engine.executor.kv.layout()  # type: ignore[attr-defined]
        info = (await holder.get("/model_info")).json()["kv_fetch"]
        assert info["kv_bytes_per_token"] == layout.block_bytes // 4 and info["serve"]
        assert info["http_bandwidth"] == HTTP_FETCH_BANDWIDTH
        async with _worker(_settings(), peer=holder.app) as d:  # type: ignore[attr-defined]
            answer = await _complete(d, PROMPT, fetch=FULL)
            result = answer.headers["x-kvroute-fetch-result"]
            assert result.startswith(f"blocks={FULL};"), result
            sent = int(result.split(";")[1].removeprefix("bytes="))
            assert FULL * layout.block_bytes < sent < FULL * layout.block_bytes + 4096
            assert _cached(answer) == FULL * 4
            assert answer.json()["choices"][0]["text"] == reference
        # The holder's pins ended with the read.
        assert holder.app._state.runtime.cache.num_pins == 0  # type: ignore[attr-defined]


async def test_a_receiver_that_holds_the_first_blocks_fetches_only_the_rest() -> None:
    async with _worker(_settings()) as alone:
        await _complete(alone, PROMPT)
        reference = (await _complete(alone, PROMPT)).json()["choices"][0]["text"]
    async with _worker(_settings()) as holder:
        await _complete(holder, PROMPT)
        async with _worker(_settings(), peer=holder.app) as d:  # type: ignore[attr-defined]
            await _complete(d, PROMPT[:15] + "#" * 24)  # D holds the first 4 blocks
            answer = await _complete(d, PROMPT, fetch=FULL)
            assert answer.headers["x-kvroute-fetch-result"].startswith(f"blocks={FULL - 4};")
            assert _cached(answer) == FULL * 4
            assert answer.json()["choices"][0]["text"] == reference


async def test_blocks_of_another_shape_are_refused_and_the_prompt_computed() -> None:
    async with _worker(_settings(block_size=8)) as alone:
        reference = (await _complete(alone, PROMPT)).json()["choices"][0]["text"]
    async with _worker(_settings()) as holder:
        await _complete(holder, PROMPT)
        # A receiver of 8-token blocks: the holder's answer names its blocks of 4, which the
        # receiver refuses before it reads a byte of the payload.
        async with _worker(_settings(block_size=8), peer=holder.app) as d:  # type: ignore[attr-defined]
            answer = await _complete(d, PROMPT, fetch=4)
            assert answer.headers["x-kvroute-fetch-result"] == "failed;reason=bad_message"
            assert answer.json()["choices"][0]["text"] == reference
