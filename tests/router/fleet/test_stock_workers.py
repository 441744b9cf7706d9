"""The router in front of a stock-engine stand-in on 127.0.0.1: it serves vLLM's recorded
``/v1/models`` and ``/metrics`` (or whatever a test puts there instead), so registration,
health, refusals and ``/workers`` are seen through the real registry and app."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from kvroute.up import free_port
from router.http.app import create_app
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.servers import UvicornServer

DATA = Path(__file__).resolve().parents[2] / "data" / "engines"


class StockVllm:
    """Answers like a vLLM server's control plane; ``metrics`` may be changed at any time."""

    def __init__(self) -> None:
        self.port = free_port()
        self.models = (DATA / "vllm_models.json").read_text()
        self.metrics = (DATA / "vllm_metrics.txt").read_text()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> StockVllm:
        async def models(_: web.Request) -> web.Response:
            return web.Response(text=self.models, content_type="application/json")

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=self.metrics)

        async def health(_: web.Request) -> web.Response:
            return web.Response()

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@contextlib.asynccontextmanager
async def router(*workers: str, **kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    settings = RouterSettings(workers=workers, health_interval=0.05, unhealthy_grace=0.2, **kw)
    async with UvicornServer(create_app(settings)) as served, httpx.AsyncClient(
            base_url=served.url) as client:
        yield client


async def listed(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    return (await client.get("/workers")).json()["workers"]  # type: ignore[no-any-return]


async def until(client: httpx.AsyncClient, check: Any, what: str) -> dict[str, Any]:
    """The first listed worker, once ``check`` holds for it."""
    workers = await eventually(lambda: listed(client), f"the worker {what}",
                               until=lambda ws: bool(ws) and check(ws[0]))
    return workers[0]


async def test_a_vllm_worker_is_described_from_its_models_and_metrics() -> None:
    async with StockVllm() as engine, router(f"{engine.url},engine=vllm") as client:
        worker = await until(client, lambda w: w["state"] == "healthy", "healthy")
        models = (await client.get("/v1/models")).json()["data"]
    assert (worker["engine"], worker["model"], worker["resync"]) == (
        "vllm", "tiny-llama", "clear_and_relearn")
    assert worker["approximate"]  # no events endpoint configured
    assert [m["id"] for m in models] == ["tiny-llama"]


async def test_a_bad_metrics_answer_makes_it_unhealthy_with_the_reason_until_fixed() -> None:
    async with StockVllm() as engine, router(f"{engine.url},engine=vllm") as client:
        await until(client, lambda w: w["state"] == "healthy", "healthy")
        good, engine.metrics = engine.metrics, "vllm:num_requests_running{ oops\n"
        worker = await until(client, lambda w: w["state"] == "unhealthy", "unhealthy")
        assert "metrics do not parse" in worker["last_error"]
        assert (await client.get("/ready")).status_code == 503
        engine.metrics = good
        await until(client, lambda w: w["state"] == "healthy", "healthy again")


async def test_a_vllm_worker_with_another_block_size_is_refused_at_post_workers() -> None:
    async with StockVllm() as engine, router(block_size=16) as client:
        refused = await client.post("/workers", json={"url": engine.url, "engine": "vllm"})
        assert refused.status_code == 409
        assert "block size 32" in refused.json()["error"]["message"]
        contradicted = await client.post("/workers", json={
            "url": engine.url, "engine": "vllm", "block_size": 16})
        assert contradicted.status_code == 409
        assert "configuration says 16" in contradicted.json()["error"]["message"]
        unknown = await client.post("/workers", json={"url": engine.url, "engine": "tgi"})
        assert unknown.status_code == 400
        assert await listed(client) == []


async def test_the_router_answers_tokenize_with_its_own_tokenizer() -> None:
    async with router() as client:
        answer = await client.post("/tokenize", json={"prompt": "ab"})
        bad = await client.post("/tokenize", json={"prompt": 7})
    assert answer.json()["tokens"][1:] == [ord("a") + 4, ord("b") + 4]  # byte tokenizer
    assert bad.status_code == 400


async def test_a_renamed_model_updates_the_model_table_with_the_reason() -> None:
    async with StockVllm() as engine, router(f"{engine.url},engine=vllm") as client:
        await until(client, lambda w: w["state"] == "healthy", "healthy")
        engine.models = engine.models.replace('"tiny-llama"', '"tiny-llama-v2"')
        worker = await until(client, lambda w: w["model"] == "tiny-llama-v2", "renamed")
        models = (await client.get("/v1/models")).json()["data"]
    assert worker["state"] == "healthy"
    assert "tiny-llama -> tiny-llama-v2" in worker["last_change"]
    assert worker["counters"]["model_changes"] == 1
    assert [m["id"] for m in models] == ["tiny-llama-v2"]


async def test_a_second_base_model_makes_it_unhealthy_with_the_reason() -> None:
    async with StockVllm() as engine, router(f"{engine.url},engine=vllm") as client:
        await until(client, lambda w: w["state"] == "healthy", "healthy")
        data = json.loads(engine.models)
        data["data"].append({**data["data"][0], "id": "other-base"})
        engine.models = json.dumps(data)
        worker = await until(client, lambda w: w["state"] == "unhealthy", "unhealthy")
    assert "2 base models" in worker["last_error"]
    assert worker["model"] == "tiny-llama"


@pytest.mark.parametrize("label, reason", [
    ("16", "the engine now reports block size 16, not 32"),
    ("abc", "block_size='abc' is not an integer"),
])
async def test_a_changed_block_size_makes_it_unhealthy_with_the_reason(label: str,
                                                                       reason: str) -> None:
    async with StockVllm() as engine, router(f"{engine.url},engine=vllm") as client:
        await until(client, lambda w: w["state"] == "healthy", "healthy")
        good, engine.metrics = engine.metrics, engine.metrics.replace(
            'block_size="32"', f'block_size="{label}"')
        worker = await until(client, lambda w: w["state"] == "unhealthy", "unhealthy")
        assert reason in worker["last_error"]
        assert (await client.get("/ready")).status_code == 503
        engine.metrics = good
        await until(client, lambda w: w["state"] == "healthy", "healthy again")
