"""The torch engine's KV transfer between two worker apps in one process: the decode worker
pulls the prefill worker's held blocks over HTTP, decodes the same greedy tokens as a worker
that computed the whole prompt, and counts the prompt as transferred; a transfer that fails
(cut short, of another shape, a lease that is gone) is counted, writes nothing, and the
request prefills locally with the same output."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from router.http.disaggregated import REMOTE_DECODE
from tests.support.lazy import LazyModule, require
from tests.support.servers import UvicornServer, free_port
from workers.http import kv_pull
from workers.http.api import create_app
from workers.http.kv_pull import PULL_TIMEOUT_S
from workers.http.kv_transfer import HeldPrefills
from workers.settings import WorkerSettings

require("torch")
torch = LazyModule("torch")  # imported by the first test that reads it

PROMPT = "Prefill there, decode here: the same tokens."  # 44 bytes + BOS: 11 full blocks
BLOCKS = (len(PROMPT.encode()) + 1 - 1) // 4


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        "not torch.cuda.is_available()", reason="no CUDA device")]),
]


def _settings(device: str = "cpu", **kw: Any) -> WorkerSettings:
    values: dict[str, Any] = {"engine": "torch", "torch_model": "tiny", "device": device,
                              "block_size": 4, "kv_memory_gb": 0.01, "events_port": 0,
                              "replay_port": 0, "cuda_graphs": False}
    return WorkerSettings(**(values | kw))


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@contextlib.asynccontextmanager
async def _worker(settings: WorkerSettings, peers: httpx.AsyncBaseTransport | None = None
                  ) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    if peers is not None:  # where this worker reaches its prefill workers
        state = app._state  # type: ignore[attr-defined]
        await state.peers.aclose()
        state.peers = httpx.AsyncClient(transport=peers, timeout=PULL_TIMEOUT_S)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://worker") as client:
        client.app = app  # type: ignore[attr-defined]
        yield client


async def _prefill(client: httpx.AsyncClient) -> dict[str, Any]:
    answer = await client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE})
    assert answer.status_code == 200, answer.text
    params: dict[str, Any] = answer.json()["kv_transfer_params"]
    return params


async def _decode(client: httpx.AsyncClient, params: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 8}
    if params is not None:
        body["kv_transfer_params"] = params
    answer = await client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


@pytest.mark.parametrize("device", DEVICES)
async def test_the_decode_worker_pulls_the_prompt_and_decodes_the_same_tokens(
        device: str) -> None:
    # The reference computes the last block over its cached prefix, as the decode worker
    # does (on the CPU, float32, that equals computing the prompt whole; bf16 on a GPU may
    # round the two paths apart).
    async with _worker(_settings(device)) as alone:
        whole, reference = await _decode(alone, None), await _decode(alone, None)
        assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * 4
        if device == "cpu":
            assert whole["choices"][0]["text"] == reference["choices"][0]["text"]
    async with _worker(_settings(device)) as prefill:
        params = await _prefill(prefill)
        assert len(params["remote_block_ids"]) == BLOCKS
        assert (await prefill.get("/load")).json()["kv_usage"] > 0  # held for the decode
        transport = httpx.ASGITransport(prefill.app)  # type: ignore[attr-defined]
        async with _worker(_settings(device), peers=transport) as decode:
            answer = await _decode(decode, params)
            assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * 4
            metrics = (await decode.get("/metrics")).text
            assert _metric(metrics, "kvroute_worker_transferred_tokens_total") == BLOCKS * 4
            assert _metric(metrics, "kvroute_worker_kv_transfer_failures_total") == 0
            # The received blocks went out as stored events, as computed ones do.
            assert _metric(metrics, "kvroute_worker_events_stored") >= 1
            assert _metric(metrics, "kvroute_worker_cache_hit_tokens") == BLOCKS * 4
        # The decode worker said it took them: the prefill worker holds nothing now, and a
        # second pull of the same lease finds nothing.
        assert (await prefill.get("/load")).json()["kv_usage"] == 0
        gone = await prefill.get(f"/kv_transfer/blocks/{params['remote_request_id']}")
        assert gone.status_code == 404 and "no prefill is held" in gone.text


def _cut(body: bytes) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/release"):
            return httpx.Response(200, json={"released": True})
        return httpx.Response(200, content=body[: len(body) // 2])
    return answer


def _oversized(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=b"KVRB" + bytes(10 << 20))


def _gone(request: httpx.Request) -> httpx.Response:
    return httpx.Response(404, json={"error": {"message": "no prefill is held"}})


@pytest.mark.parametrize("failure", ["cut short", "more than", "answered 404", "shaped"])
async def test_a_failed_transfer_is_counted_and_the_prompt_is_prefilled_locally(
        failure: str, caplog: pytest.LogCaptureFixture) -> None:
    async with _worker(_settings()) as alone:
        reference = await _decode(alone, None)
    async with _worker(_settings()) as prefill:
        params = await _prefill(prefill)
        real = await prefill.get(f"/kv_transfer/blocks/{params['remote_request_id']}")
        assert real.status_code == 200 and real.content.startswith(b"KVRB")
        transport: httpx.AsyncBaseTransport = httpx.ASGITransport(prefill.app)  # type: ignore[attr-defined]
        handler = {"cut short": _cut(real.content), "more than": _oversized,
                   "answered 404": _gone}.get(failure)
        if handler is not None:
            transport = httpx.MockTransport(handler)
        # Blocks of 8 positions cannot take the prefill worker's blocks of 4.
        settings = _settings(block_size=8) if failure == "shaped" else _settings()
        async with _worker(settings, peers=transport) as decode:
            answer = await _decode(decode, params)
            assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            metrics = (await decode.get("/metrics")).text
            assert _metric(metrics, "kvroute_worker_kv_transfer_failures_total") == 1
            assert _metric(metrics, "kvroute_worker_transferred_tokens_total") == 0
        assert any(failure in r.getMessage() and "prefilling the prompt here" in r.getMessage()
                   for r in caplog.records)


async def test_a_lease_that_ends_while_its_blocks_are_sent_cuts_the_answer_short(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A real server, sending one block at a time; the prefill worker's lease clock jumps past
    # the lease after the first block is read: the rest is not sent, the decode worker
    # refuses what came and prefills the prompt itself.
    monkeypatch.setattr(kv_pull, "CHUNK_BLOCKS", 1)
    async with _worker(_settings()) as alone:
        reference = await _decode(alone, None)
    port = free_port()
    app = create_app(_settings(port=port))
    state = app._state  # type: ignore[attr-defined]
    now = [0.0]
    state.held_prefills = HeldPrefills(30.0, clock=lambda: now[0])
    async with UvicornServer(app, port=port) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30) as prefill:
        params = await _prefill(prefill)
        kv = state.runtime.engine.executor.kv
        read = kv.read_blocks

        def read_then_end(block_ids: Any) -> bytes:
            now[0] = 100.0  # the lease is over from now on
            return bytes(read(block_ids))

        monkeypatch.setattr(kv, "read_blocks", read_then_end)
        async with _worker(_settings(), peers=httpx.AsyncHTTPTransport()) as decode:
            answer = await _decode(decode, params)
            metrics = (await decode.get("/metrics")).text
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _metric(metrics, "kvroute_worker_kv_transfer_failures_total") == 1
    assert any("could not be read" in r.getMessage() for r in caplog.records)
