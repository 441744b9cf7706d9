"""Control-plane answers over the size limit, from a stock-engine stand-in on 127.0.0.1.

The stand-in streams its oversized answers lazily, chunk by chunk with no length, so neither
it nor the test holds the answer: what the router reads before it stops is what it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from kvroute.up import free_port
from router.fleet.engines.base import MAX_ANSWER_BYTES
from router.http.app import create_app
from router.settings import RouterSettings
from tests.support.servers import UvicornServer

DATA = Path(__file__).resolve().parents[2] / "data" / "engines"
CHUNK = b"# " + b"x" * (64 * 1024 - 3) + b"\n"  # a Prometheus comment line: valid text


class GrowingVllm:
    """Answers like vLLM; ``oversize`` names paths whose answer grows to ``size`` bytes."""

    def __init__(self, size: int = 64 * MAX_ANSWER_BYTES) -> None:
        self.port = free_port()
        self.size = size
        self.oversize: set[str] = set()
        self.sent: dict[str, int] = {}  # bytes written per oversized answer, the last one
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _answer(self, request: web.Request, text: str) -> web.StreamResponse:
        path = request.path
        if path not in self.oversize:
            return web.Response(text=text)
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        self.sent[path] = 0
        with contextlib.suppress(ConnectionError, RuntimeError):
            while self.sent[path] < self.size:
                await response.write(CHUNK)
                self.sent[path] += len(CHUNK)
            await response.write_eof()
        return response

    async def __aenter__(self) -> GrowingVllm:
        models = (DATA / "vllm_models.json").read_text()
        metrics = (DATA / "vllm_metrics.txt").read_text()

        async def answer_models(request: web.Request) -> web.StreamResponse:
            return await self._answer(request, models)

        async def answer_metrics(request: web.Request) -> web.StreamResponse:
            return await self._answer(request, metrics)

        async def health(request: web.Request) -> web.StreamResponse:
            return await self._answer(request, "")

        app = web.Application()
        app.router.add_get("/v1/models", answer_models)
        app.router.add_get("/metrics", answer_metrics)
        app.router.add_get("/health", health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@contextlib.asynccontextmanager
async def router(*workers: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = RouterSettings(workers=workers, health_interval=0.05, unhealthy_grace=0.2)
    async with UvicornServer(create_app(settings)) as served, httpx.AsyncClient(
            base_url=served.url) as client:
        yield client


async def until(client: httpx.AsyncClient, check: Any, what: str) -> dict[str, Any]:
    workers: list[dict[str, Any]] = []
    for _ in range(500):
        workers = (await client.get("/workers")).json()["workers"]
        if workers and check(workers[0]):
            return workers[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"never {what}: {workers}")


async def oversize_count(client: httpx.AsyncClient, url: str) -> float:
    ids = {w["url"]: w["id"] for w in (await client.get("/workers")).json()["workers"]}
    text = (await client.get("/metrics")).text
    line = f'kvroute_control_answers_oversize_total{{worker="{ids[url]}"}} '
    found = [ln for ln in text.splitlines() if ln.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


async def test_a_metrics_answer_that_grows_past_the_limit_makes_the_worker_unhealthy() -> None:
    async with GrowingVllm() as engine, router(f"{engine.url},engine=vllm") as client:
        await until(client, lambda w: w["state"] == "healthy", "healthy")
        engine.oversize.add("/metrics")
        worker = await until(client, lambda w: w["state"] == "unhealthy", "unhealthy")
        assert worker["last_error"] == (
            f"metrics scrape failed: the answer of {engine.url}/metrics is over "
            f"{MAX_ANSWER_BYTES} bytes")
        assert await oversize_count(client, engine.url) >= 1
        # The router stopped reading near the limit: the rest was never sent, let alone held
        # (what socket buffers took on the way is the slack).
        assert engine.sent["/metrics"] < 4 * MAX_ANSWER_BYTES
        engine.oversize.clear()
        await until(client, lambda w: w["state"] == "healthy", "healthy again")


async def test_oversized_models_or_health_answers_are_refused_with_the_reason() -> None:
    async with GrowingVllm() as engine:
        engine.oversize.add("/v1/models")
        async with router(f"{engine.url},engine=vllm") as client:
            worker = await until(client, lambda w: w["last_error"], "refused")
            assert worker["state"] == "unhealthy"
            assert f"the answer of {engine.url}/v1/models is over" in worker["last_error"]
            assert await oversize_count(client, engine.url) >= 1
            engine.oversize = {"/health"}
            worker = await until(client, lambda w: "/health" in (w["last_error"] or ""),
                                 "refused at /health")
            assert worker["state"] == "unhealthy"
            engine.oversize.clear()
            await until(client, lambda w: w["state"] == "healthy", "healthy")
