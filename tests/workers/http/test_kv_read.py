"""``POST /kv_transfer/read`` on a sim worker: the leading run of the named blocks it holds
(none, part, all), nothing for keys of another salt, a malformed body refused naming the
field, and who may read: the bearer secret, or loopback peers of a loopback bind only; the
same rule on the P/D lease endpoints."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from openai_request.bodies import ApiError
from openai_request.prompts import build_prompt
from router.fleet.worker_answers import parse_model_info
from workers.cache.block_keys import Prompt, RequestBlocks, Scope
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink
from workers.engine.batcher import Batcher, EngineRequest
from workers.engine.executor import SimExecutor
from workers.engine.loop import Engine
from workers.engine.timing import DEFAULT_TIMING, TIMING_MODELS
from workers.http.api import create_app
from workers.http.kv_fetch import MAX_ADVERTISED_BANDWIDTH
from workers.http.kv_read import MAX_READ_BLOCKS, BlockReads, reserve_blocks
from workers.settings import WorkerSettings, WorkerSettingsError

SECRET = "s3cret-of-sixteen-bytes"
#: 24 bytes + BOS: 6 full blocks of 4, the last one partial.
PROMPT = "a prompt a peer may read"


def sim_settings(**kw: Any) -> WorkerSettings:
    values: dict[str, Any] = {"block_size": 4, "num_blocks": 256, "events_port": None,
                              "replay_port": None, "speedup": 1000.0}
    return WorkerSettings(**(values | kw))


@contextlib.asynccontextmanager
async def worker(settings: WorkerSettings, client_host: str = "127.0.0.1"
                 ) -> AsyncIterator[httpx.AsyncClient]:
    """A worker app and a client that reaches it from ``client_host``; ``client.app`` is the
    app."""
    app = create_app(settings)
    transport = httpx.ASGITransport(app, client=(client_host, 50000))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=transport, base_url="http://worker") as client:
        client.app = app  # type: ignore[attr-defined]
        yield client


def state(client: httpx.AsyncClient) -> Any:
    return client.app._state  # type: ignore[attr-defined]


def prompt_of(client: httpx.AsyncClient, text: str, salt: str | None = None) -> Prompt:
    """The engine prompt of a completions prompt ``text`` on this worker."""
    runtime = state(client).runtime
    body: dict[str, Any] = {"prompt": text} | ({"cache_salt": salt} if salt else {})
    tokens = build_prompt(body, "completions", runtime.tokenizer, mm_tokens_per_image=16,
                          max_image_bytes=1 << 20, fetch=None)
    return Prompt(tokens.token_ids, scope=Scope(salt=tokens.cache_salt))


def keys(client: httpx.AsyncClient, text: str, salt: str | None = None) -> list[str]:
    """The engine block keys of a completions prompt ``text`` on this worker, as hex."""
    blocks = RequestBlocks(prompt_of(client, text, salt), state(client).settings.block_size)
    return [blocks.block(i).key.hex() for i in range(blocks.num_full_blocks)]


async def complete(client: httpx.AsyncClient, text: str, headers: dict[str, str] | None = None,
                   **body: Any) -> httpx.Response:
    answer = await client.post("/v1/completions", headers=headers,
                               json={"prompt": text, "max_tokens": 2} | body)
    assert answer.status_code == 200, answer.text
    return answer


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


async def test_a_read_answers_the_leading_run_of_the_named_blocks_held() -> None:
    async with worker(sim_settings()) as holder:
        named = keys(holder, PROMPT)
        assert len(named) == 6
        nothing = await holder.post("/kv_transfer/read", json={"block_keys": named})
        assert nothing.status_code == 200 and nothing.json() == {"blocks": 0}
        # A prompt sharing the first 12 bytes caches 3 blocks of it (block 3 differs).
        await complete(holder, PROMPT[:11] + "X" * 13)
        part = await holder.post("/kv_transfer/read", json={"block_keys": named})
        assert part.json() == {"blocks": 3}
        # The whole prompt: 6 full blocks, all committed once it ran.
        await complete(holder, PROMPT)
        whole = await holder.post("/kv_transfer/read", json={"block_keys": named})
        assert whole.json() == {"blocks": 6}
        # A miss ends the run even when later blocks are held.
        holed = [*named[:2], "00" * 32, *named[3:]]
        assert (await holder.post("/kv_transfer/read", json={"block_keys": holed})
                ).json() == {"blocks": 2}
        # Nothing stays pinned after an answer.
        assert state(holder).runtime.cache.num_pins == 0
        text = (await holder.get("/metrics")).text
        assert metric(text, 'kvroute_worker_kv_reads_total{outcome="served"}') == 3
        assert metric(text, 'kvroute_worker_kv_reads_total{outcome="missing"}') == 1


async def test_keys_of_another_salt_find_nothing() -> None:
    async with worker(sim_settings()) as holder:
        await complete(holder, PROMPT, cache_salt="tenant-a")
        mine = keys(holder, PROMPT, salt="tenant-a")
        theirs = keys(holder, PROMPT, salt="tenant-b")
        unsalted = keys(holder, PROMPT)
        assert (await holder.post("/kv_transfer/read", json={"block_keys": mine})
                ).json() == {"blocks": 6}
        for other in (theirs, unsalted):
            assert (await holder.post("/kv_transfer/read", json={"block_keys": other})
                    ).json() == {"blocks": 0}


@pytest.mark.parametrize(("body", "reason"), [
    ({}, "block_keys must be a list"),
    ({"block_keys": "ab"}, "block_keys must be a list"),
    ({"block_keys": ["00" * 31]}, "block_keys\\[0\\] must be 64 hex digits"),
    ({"block_keys": ["zz" * 32]}, "block_keys\\[0\\] is not hex"),
    ({"block_keys": [1]}, "must be 64 hex digits"),
    ({"block_keys": ["00" * 32] * (MAX_READ_BLOCKS + 1)}, "at most"),
])
async def test_a_malformed_read_is_refused_naming_the_field(body: Any, reason: str) -> None:
    async with worker(sim_settings()) as holder:
        answer = await holder.post("/kv_transfer/read", json=body)
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "block_keys"
        assert re.search(reason, answer.json()["error"]["message"])
        text = (await holder.get("/metrics")).text
        assert metric(text, 'kvroute_worker_kv_reads_total{outcome="refused"}') == 1


async def test_with_a_secret_a_read_needs_the_bearer_from_any_address() -> None:
    async with worker(sim_settings(host="10.1.2.3", admin_token="admin-token",
                                   kv_transfer_secret=SECRET),
                      client_host="10.9.9.9") as holder:
        await complete(holder, PROMPT)
        named = {"block_keys": keys(holder, PROMPT)}
        for given in (None, "Bearer wrong-secret-of-16-bytes", SECRET, f"Bearer {SECRET}x"):
            headers = {} if given is None else {"authorization": given}
            answer = await holder.post("/kv_transfer/read", json=named, headers=headers)
            assert answer.status_code == 401, given
            assert "Bearer" in answer.json()["error"]["message"]
        good = {"authorization": f"Bearer {SECRET}"}
        answer = await holder.post("/kv_transfer/read", json=named, headers=good)
        assert answer.status_code == 200 and answer.json() == {"blocks": 6}
        # The P/D lease endpoints follow the same rule.
        assert (await holder.get("/kv_transfer/blocks/lease-x")).status_code == 401
        assert (await holder.post("/kv_transfer/release", json={"remote_request_id": "x"})
                ).status_code == 401
        assert (await holder.post("/kv_transfer/release", json={"remote_request_id": "x"},
                                  headers=good)).json() == {"released": False}
        info = (await holder.get("/model_info")).json()["kv_fetch"]
        # A pair's first fetch is priced at what its HTTP fetches move: the sim engine's
        # modelled 25 GB/s times its speedup.
        assert info == {"serve": True, "receive": True, "kv_bytes_per_token": 131072,
                        "transfer": "http", "http_bandwidth": 25e9 * 1000}


async def test_an_operator_says_what_the_workers_http_fetches_move() -> None:
    async with worker(sim_settings(kv_fetch_bandwidth=3e8)) as holder:
        assert (await holder.get("/model_info")).json()["kv_fetch"]["http_bandwidth"] == 3e8
    with pytest.raises(WorkerSettingsError, match="kv_fetch_bandwidth must be >= 0"):
        sim_settings(kv_fetch_bandwidth=-1.0)


async def test_a_fast_sim_workers_advertised_bandwidth_is_one_a_router_accepts() -> None:
    """A sim worker's modelled 25 GB/s scales with its speedup; what it advertises must stay
    within the bound a router's /model_info schema accepts, or the router holds it out of the
    fleet as malformed."""
    for speedup, advertised in ((1e6, 2.5e16), (1e8, MAX_ADVERTISED_BANDWIDTH)):
        async with worker(sim_settings(speedup=speedup)) as holder:
            raw = (await holder.get("/model_info")).content
        assert json.loads(raw)["kv_fetch"]["http_bandwidth"] == advertised
        assert parse_model_info("http://w", raw).kv_fetch_http_bandwidth == advertised


async def test_without_a_secret_only_loopback_peers_of_a_loopback_bind_read(
        caplog: pytest.LogCaptureFixture) -> None:
    async with worker(sim_settings(), client_host="10.9.9.9") as holder:
        answer = await holder.post("/kv_transfer/read", json={"block_keys": []})
        assert answer.status_code == 403 and "loopback peers only" in answer.text
        assert (await holder.get("/kv_transfer/blocks/lease-x")).status_code == 403
    async with worker(sim_settings(), client_host="::1") as holder:
        answer = await holder.post("/kv_transfer/read", json={"block_keys": []})
        assert answer.status_code == 200
    # Bound off loopback with no secret: no KV to anyone, not even loopback, and the
    # worker says it does not take part.
    async with worker(sim_settings(host="0.0.0.0", admin_token="admin-token")) as holder:
        answer = await holder.post("/kv_transfer/read", json={"block_keys": []})
        assert answer.status_code == 403 and "kv-transfer-secret-file" in answer.text
        assert (await holder.post("/kv_transfer/release", json={"remote_request_id": "x"})
                ).status_code == 403
        info = (await holder.get("/model_info")).json()["kv_fetch"]
        assert info["serve"] is False and info["receive"] is False
    assert any("peer KV fetch is off" in r.getMessage() and "0.0.0.0" in r.getMessage()
               for r in caplog.records)


async def test_a_read_past_the_read_slots_is_answered_503_at_once() -> None:
    async with worker(sim_settings(kv_read_concurrency=1)) as holder:
        await complete(holder, PROMPT)
        named = keys(holder, PROMPT)
        reads = state(holder).block_reads
        pin_id, _, block_ids = reads.pin([bytes.fromhex(k) for k in named])
        assert len(block_ids) == 6  # one read in progress, its blocks pinned
        busy = await holder.post("/kv_transfer/read", json={"block_keys": named})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "busy"
        reads.finish(pin_id)
        assert state(holder).runtime.cache.num_pins == 0
        assert (await holder.post("/kv_transfer/read", json={"block_keys": named})
                ).json() == {"blocks": 6}


def test_a_holder_part_way_through_a_long_prompt_still_serves_what_it_holds() -> None:
    # 16 blocks of 4: a 3-block prompt cached and let go (evictable), then a 12-block prompt
    # admitted and prefilling, its blocks taken at admission: one block is free. Nothing
    # waits, so a read keeps nothing free for it and pins the 3 blocks; with a request
    # waiting for 2 blocks, only what leaves those free.
    cache = CacheManager(num_blocks=16, block_size=4)
    held = Prompt(tuple(range(1, 14)))
    cache.allocate("held", held)
    cache.commit_computed("held", 12)
    cache.free("held")
    batcher = Batcher(cache, max_num_batched_tokens=8)
    engine = Engine(cache, batcher, SimExecutor(TIMING_MODELS[DEFAULT_TIMING], block_size=4),
                    EventSink(), None)
    batcher.add(EngineRequest("long", Prompt(tuple(range(100, 148))), 1))
    assert batcher.schedule() is not None and batcher.pending_prefill_tokens == 48
    assert (cache.pool.num_free_blocks, reserve_blocks(engine)) == (4, 0)  # 1 + 3 evictable
    named = [RequestBlocks(held, 4).block(i).key for i in range(3)]
    reads = BlockReads([engine], concurrency=2)
    pin, _, blocks = reads.pin(named)
    assert len(blocks) == 3
    reads.finish(pin)
    batcher.add(EngineRequest("next", Prompt(tuple(range(200, 208))), 1))
    assert reserve_blocks(engine) == 2
    pin, _, blocks = reads.pin(named)
    assert len(blocks) == 2  # of 4 free or evictable, 2 kept free
    reads.finish(pin)
    # Waiting requests that need every block: it holds them and may pin none, and says so.
    batcher.add(EngineRequest("more", Prompt(tuple(range(300, 308))), 1))
    with pytest.raises(ApiError, match="keeps its free blocks") as refused:
        reads.pin(named)
    assert (refused.value.status, refused.value.code) == (503, "no_room")
    assert cache.num_pins == 0


async def test_a_read_is_served_by_the_rank_that_holds_the_blocks() -> None:
    async with worker(sim_settings(data_parallel_size=2)) as holder:
        await complete(holder, PROMPT, headers={"x-data-parallel-rank": "1"})
        named = keys(holder, PROMPT)
        assert (await holder.post("/kv_transfer/read", json={"block_keys": named})
                ).json() == {"blocks": 6}
        engines = state(holder).runtime.engines
        raw = [bytes.fromhex(k) for k in named]
        assert [e.cache.cached_run(raw) for e in engines] == [0, 6]  # rank 1 alone holds them
        assert [e.cache.num_pins for e in engines] == [0, 0]
