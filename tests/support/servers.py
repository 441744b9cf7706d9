"""Real HTTP servers for tests, on 127.0.0.1 with free ports, started and stopped cleanly.

- :class:`UvicornServer` serves an ASGI app (the router or a worker app) in this event loop,
  configured as ``kvroute router`` and ``kvroute worker`` serve theirs.
- :class:`ScriptedWorker` is a worker that misbehaves on purpose (refuses, dies mid-stream,
  streams slowly) so the router's failure rules can be tested; it speaks just enough of the
  worker API (``/model_info``, ``/load``, ``/v1/completions``) and publishes no events, so
  the router treats it as an approximate-mode worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import uvicorn
from aiohttp import web

from httpapi.server import DEFAULT_LIMITS, ConnectionLimits, server_config
from kvroute.up import free_port


class UvicornServer:
    """An ASGI app served by uvicorn on 127.0.0.1 inside the running event loop."""

    def __init__(self, app: Any, port: int | None = None,
                 limits: ConnectionLimits = DEFAULT_LIMITS) -> None:
        self.port = port or free_port()
        config = server_config(app, "127.0.0.1", self.port, limits, log_level="warning",
                               lifespan="on")
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> UvicornServer:
        self._task = asyncio.create_task(self.server.serve())
        for _ in range(500):
            if self.server.started:
                return self
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        raise RuntimeError("uvicorn did not start in 5 s")

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, 10)


class ScriptedWorker:
    """A worker whose completions follow ``mode``: "ok", "refuse" (HTTP 503 before any byte),
    "die_mid_stream" (two chunks, then the connection drops), "slow" (one chunk every 50 ms
    for 10 s, recording when the client goes away)."""

    def __init__(self, mode: str = "ok", *, block_size: int = 32, model: str = "kvroute-sim",
                 tokenizer: str = "bytes-v1", max_num_seqs: int = 0) -> None:
        self.mode = mode
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.model = model
        self.tokenizer = tokenizer
        self.port = free_port()
        self.instance_id = "scripted-1"
        self.requests: list[dict[str, Any]] = []
        self.cancelled = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ScriptedWorker:
        app = web.Application()
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/load", self._load)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _model_info(self, _: web.Request) -> web.Response:
        info = {"model": self.model, "block_size": self.block_size, "tokenizer": self.tokenizer,
                "instance_id": self.instance_id, "events_endpoint": None,
                "max_model_len": 100000}
        if self.max_num_seqs:
            info["capacity"] = {"max_num_seqs": self.max_num_seqs}
        return web.json_response(info)

    async def _load(self, _: web.Request) -> web.Response:
        return web.json_response({"running": 0, "waiting": 0})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.mode == "refuse":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        chunk = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
        if not body.get("stream") and self.mode == "slow":
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "text": "ok"}],
                                      "usage": {"prompt_tokens": 1,
                                                "prompt_tokens_details": {"cached_tokens": 0}}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.mode == "die_mid_stream":
            await response.write(chunk)
            await response.write(chunk)
            assert request.transport is not None
            request.transport.abort()
            return response
        try:
            for _ in range(200 if self.mode == "slow" else 3):
                await response.write(chunk)
                if self.mode == "slow":
                    await asyncio.sleep(0.05)
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.cancelled.set()
            raise
        return response


def sse_events(raw: bytes) -> list[Any]:
    """Parse an SSE body into its ``data:`` payloads (JSON decoded; ``[DONE]`` kept as is)."""
    out: list[Any] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
