"""The worker's HTTP API through httpx against the real app (its engine, publisher and
sockets started by the app's lifespan): answers, streaming, usage, capability gating, admin
endpoints, and what every bad input gets."""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from indexer.decode import decode_batch
from indexer.events import Cleared, Stored
from router.events.subscriber import Delivered, EventSubscriber
from workers.http.api import create_app
from workers.settings import WorkerSettings

PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(200))).decode()
TEXT = "The quick brown fox jumps over the lazy dog. " * 4  # 180 bytes: 5 full blocks


def fast(**kw: Any) -> WorkerSettings:
    base: dict[str, Any] = {"events_port": 0, "replay_port": 0, "speedup": 1e6,
                            "mm_tokens_per_image": 4}
    return WorkerSettings(**{**base, **kw})


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(fast(admin_token="t0k", loras=("sql-adapter",)))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://worker") as c:
        yield c


ADMIN = {"Authorization": "Bearer t0k"}


async def test_completion_reports_usage_and_cached_tokens(client: httpx.AsyncClient) -> None:
    body = {"model": "kvroute-sim", "prompt": TEXT, "max_tokens": 6}
    first = (await client.post("/v1/completions", json=body)).json()
    again = (await client.post("/v1/completions", json=body)).json()
    assert first["object"] == "text_completion"
    assert len(first["choices"][0]["text"]) == 6
    assert first["choices"][0]["finish_reason"] == "length"
    # 180 bytes plus the BOS token the completions API adds
    assert first["usage"] == {"prompt_tokens": 181, "completion_tokens": 6,
                              "total_tokens": 187, "prompt_tokens_details": {"cached_tokens": 0}}
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    assert again["choices"][0]["text"] == first["choices"][0]["text"], "deterministic"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_names_the_workers_own_time_within_the_round_trip(
        client: httpx.AsyncClient, stream: bool) -> None:
    body = {"model": "kvroute-sim", "prompt": TEXT, "max_tokens": 2, "stream": stream}
    started = time.perf_counter()
    r = await client.post("/v1/completions", json=body)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    assert r.status_code == 200
    found = re.fullmatch(r"worker;dur=(\d+\.\d{3})", r.headers["server-timing"])
    assert found, r.headers["server-timing"]
    assert 0 < float(found.group(1)) <= elapsed_ms


async def test_token_id_prompts_are_accepted(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": list(range(10, 80)),
                                                   "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 70


async def test_chat_streams_with_usage(client: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(d) for d in data[:-1]]
    assert data[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 3


async def test_chat_with_an_image_is_served(client: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": PNG}}]}],
        "max_tokens": 2}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


async def test_lora_adapters_are_models(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["kvroute-sim", "sql-adapter"]
    r = await client.post("/v1/completions", json={"model": "sql-adapter", "prompt": TEXT,
                                                   "max_tokens": 1})
    assert r.status_code == 200


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/completions", b"{bad", 400, "not valid JSON"),
    ("/v1/completions", b'"a string"', 400, "JSON object"),
    ("/v1/completions", b'{"max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', 404, "does not exist"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n=1"),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "one prompt"),
    ("/v1/completions", b'{"prompt": [1, 99999]}', 400, "token"),
    ("/v1/completions", b'{"prompt": "x", "cache_salt": 5}', 400, "cache_salt"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 70000}', 400, "exceeds"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400,
     "role"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
     b'{"url": "data:image/png;base64,@@@"}}]}]}', 400, "base64"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
     b'{"url": "data:text/plain;base64,aGk="}}]}]}', 400, "image"),
    ("/v1/chat/completions",
     b'{"mm_uuids": ["a", "b"], "messages": [{"role": "user", "content": [{"type": '
     b'"image_url", "image_url": {"url": "data:image/png;base64,aGk="}}]}]}', 400,
     "UUID list does not match"),
])
async def test_bad_input_gets_an_openai_error_and_changes_nothing(
        client: httpx.AsyncClient, path: str, body: bytes, status: int, fragment: str) -> None:
    before = (await client.get("/load")).json()
    r = await client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"]
    assert (await client.get("/load")).json() == before
    snapshot = (await client.get("/kv/snapshot", headers=ADMIN)).json()
    assert snapshot["blocks"] == 0, "nothing half-applied stays in the cache"


async def test_oversized_image_is_refused() -> None:
    app = create_app(fast(max_image_bytes=64))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://w") as c:
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": PNG}}]}]}
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "bytes" in r.json()["error"]["message"]


async def test_admin_endpoints_need_the_token(client: httpx.AsyncClient) -> None:
    assert (await client.post("/reset_prefix_cache")).status_code == 401
    assert (await client.get("/kv/snapshot")).status_code == 401
    assert (await client.post("/debug/drop_events", json={"batches": 1})).status_code == 401
    assert (await client.post("/debug/drop_events", headers=ADMIN,
                              json={"batches": -1})).status_code == 400


async def test_snapshot_restores_every_resident_block(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1})
    snap = (await client.get("/kv/snapshot", headers=ADMIN)).json()
    batch = decode_batch(base64.b64decode(snap["payload_b64"]))
    stored = [e for e in batch.events if isinstance(e, Stored)]
    assert snap["seq"] >= 0 and snap["blocks"] == 5
    assert sum(len(e.block_hashes) for e in stored) == 5
    assert stored[0].parent_block_hash is None


@pytest.mark.parametrize("off, expect_version", [
    ({}, 1), ({"events_port": None}, None), ({"prefix_caching": False}, None),
    ({"images": False}, None), ({"image_hints": False}, None),
])
async def test_image_routing_capability_needs_every_prerequisite(
        off: dict[str, Any], expect_version: int | None) -> None:
    app = create_app(fast(**off))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://w") as c:
        info = (await c.get("/model_info")).json()
    assert info["extra"].get("trtllm_image_routing_version") == expect_version
    assert (info["events_endpoint"] is None) == ("events_port" in off or "prefix_caching" in off)


async def test_without_prefix_caching_nothing_is_reused() -> None:
    app = create_app(fast(prefix_caching=False))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://w") as c:
        body = {"prompt": TEXT, "max_tokens": 1}
        await c.post("/v1/completions", json=body)
        again = (await c.post("/v1/completions", json=body)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_reset_publishes_all_blocks_cleared_to_a_real_subscriber(
        notice_log: Any) -> None:
    app = create_app(fast())
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://w") as c:
        info = (await c.get("/model_info")).json()
        log = notice_log()
        sub = EventSubscriber(info["events_endpoint"], log,
                              replay_endpoint=info["replay_endpoint"], from_seq=0)
        await sub.start()
        await c.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1})
        assert (await c.get("/load")).json()["running"] == 0, "no request in flight"
        r = await c.post("/reset_prefix_cache")
        assert r.json() == {"reset": True}
        await log.wait_for(lambda items: any(
            isinstance(n, Delivered) and any(isinstance(e, Cleared) for e in n.batch.events)
            for n in items), what="AllBlocksCleared")
        await sub.stop()
        snapshot = (await c.get("/kv/snapshot")).json()
    stores = [e for n in log.of(Delivered) for e in n.batch.events if isinstance(e, Stored)]
    assert sum(len(e.block_hashes) for e in stores) == 5, "the blocks before the reset"
    assert snapshot["blocks"] == 0


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
async def test_no_api_description_is_served(client: httpx.AsyncClient, path: str) -> None:
    # It would list the admin endpoints (reset, snapshot, faults) to anyone.
    assert (await client.get(path)).status_code == 404


async def test_too_many_images_are_refused_with_the_limit_named_and_counted() -> None:
    app = create_app(fast(max_images_per_request=2))
    parts = [{"type": "image_url", "image_url": {"url": PNG}}] * 3
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://worker") as c:
        r = await c.post("/v1/chat/completions", json=body)
        text = (await c.get("/metrics")).text
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "a request may carry at most 2 images (max_images_per_request)")
    assert 'kvroute_worker_image_limits_total{limit="max_images_per_request"} 1.0' in text
