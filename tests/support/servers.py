"""Real HTTP servers for tests, on 127.0.0.1 with free ports, started and stopped cleanly.

- :class:`UvicornServer` serves an ASGI app (the router or a worker app) in this event loop,
  configured as ``kvroute router`` and ``kvroute worker`` serve theirs.
- :class:`ScriptedWorker` is a worker that misbehaves on purpose (refuses, fails a stream
  before its first token, dies mid-stream, streams slowly, answers garbage or nothing to its
  control calls) so the router's failure rules can be tested; it speaks just enough of the
  worker API (``/model_info``, ``/load``, ``/v1/completions``) and publishes no events, so
  the router treats it as an approximate-mode worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

import uvicorn
from aiohttp import web

from httpapi.server import DEFAULT_LIMITS, ConnectionLimits, server_config
from kvroute.up import free_port
from tests.support.eventually import eventually


class _StoppableServer(uvicorn.Server):
    """uvicorn's server, stopped without its waits on the clock: its main loop looks for
    ``should_exit`` every 0.1 s, and its shutdown pauses 0.1 s after telling the connections
    to close and then looks for them every 0.1 s; a suite that stops about 250 servers waited
    on those ~50 s. Here an event ends the main loop, and the shutdown looks every 10 ms."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stop = asyncio.Event()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):  # the date header, each second; the exit
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.1)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, step for step, but for the clock: stop listening, tell each
        connection to close, wait (up to the graceful timeout) for the connections and the
        tasks to end, then the app's lifespan shutdown."""
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        state = self.server_state
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while state.connections or state.tasks:
                    await asyncio.sleep(0.01)
                for server in self.servers:
                    await server.wait_closed()
        except TimeoutError:
            for task in state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()


class UvicornServer:
    """An ASGI app served by uvicorn on 127.0.0.1 inside the running event loop."""

    def __init__(self, app: Any, port: int | None = None,
                 limits: ConnectionLimits = DEFAULT_LIMITS) -> None:
        self.port = port or free_port()
        config = server_config(app, "127.0.0.1", self.port, limits, log_level="warning",
                               lifespan="on")
        self.server = _StoppableServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> UvicornServer:
        self._task = asyncio.create_task(self.server.serve())

        def started() -> bool:
            if self._task.done():
                self._task.result()  # it failed to start: raise its error
            return bool(self.server.started)

        await eventually(started, "uvicorn to start", interval=0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.server.stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, 10)


class ScriptedWorker:
    """A worker whose completions follow ``mode``: "ok", "refuse" (HTTP 503 before any byte),
    "refuse_unread" (HTTP 503 as soon as the request's headers are in, its body unread),
    "reject" (HTTP 400, as for a prompt longer than the worker takes),
    "fail_stream" (a stream whose first event is the engine's error), "stall" (takes the
    request, sends a stream's headers, then nothing until the client goes away),
    "die_mid_stream" (two chunks, then the connection drops), "slow" (one chunk every 50 ms for
    10 s, recording when the client goes away), "paced" (a stream that sends one chunk per
    :meth:`release` and ends at :meth:`finish`).

    ``kv_load_failures``: how many of the next requests that bring a remote prefill's
    ``kv_transfer_params`` it fails with a 500 before any byte, as a vLLM decode server whose
    NixlConnector handshake timed out does ("KV load failure"); whole requests it serves.

    Its control answers can be set while it runs: ``load_answer`` (the raw bytes ``/load``
    answers), ``model_info_extra`` (fields merged into ``/model_info``), ``answer_extra``
    (fields merged into whole completions answers), ``answer_headers`` (headers on every
    completions answer, as a worker's ``x-kvroute-fetch-result``),
    ``model_info_hangs`` (set: ``/model_info`` waits until :meth:`resume`; ``model_info_calls``
    counts the calls begun and ``model_info_ended`` those that ended), :meth:`hang_load`
    (``/load`` waits until :meth:`resume`, as a worker too busy to answer its probe) and
    :meth:`pause` (every call waits until :meth:`resume`, as a paused process would)."""

    def __init__(self, mode: str = "ok", *, block_size: int = 32, model: str = "kvroute-sim",
                 tokenizer: str = "bytes-v1", max_num_seqs: int = 0,
                 max_model_len: int = 100000) -> None:
        self.mode = mode
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.load_answer = b'{"running": 0, "waiting": 0}'
        self.model_info_extra: dict[str, Any] = {}
        #: Fields merged into every whole (non-streamed) completions answer.
        self.answer_extra: dict[str, Any] = {}
        self.answer_headers: dict[str, str] = {}
        self.kv_load_failures = 0
        self.hang = False
        self.model_info_hangs = False
        self.model_info_calls = self.model_info_ended = 0
        self.load_hangs = False
        self._paced: asyncio.Queue[bool] = asyncio.Queue()
        self._resumed = asyncio.Event()
        self.block_size = block_size
        self.model = model
        self.tokenizer = tokenizer
        self.port = free_port()
        self.instance_id = "scripted-1"
        self.requests: list[dict[str, Any]] = []
        #: Each completions request's body as received, its headers, and whether one began
        #: (set once its headers are in, before its body is read).
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.began = asyncio.Event()
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
        self.resume()
        if self._runner is not None:
            await self._runner.cleanup()

    def pause(self) -> None:
        """Stop answering (every call waits), as SIGSTOP would."""
        self.hang = True
        self._resumed.clear()

    def hang_model_info(self) -> None:
        """Let ``/model_info`` wait (until :meth:`resume`); the other calls answer."""
        self.model_info_hangs = True
        self._resumed.clear()

    def hang_load(self) -> None:
        """Let ``/load`` wait (until :meth:`resume`); the other calls answer."""
        self.load_hangs = True
        self._resumed.clear()

    def resume(self) -> None:
        """Answer again; the calls that waited go on."""
        self.hang = self.model_info_hangs = self.load_hangs = False
        self._resumed.set()

    def release(self) -> None:
        """"paced" mode: send the stream's next chunk."""
        self._paced.put_nowait(True)

    def finish(self) -> None:
        """"paced" mode: end the stream."""
        self._paced.put_nowait(False)

    async def _wait_if_paused(self) -> None:
        if self.hang:
            await self._resumed.wait()

    async def _model_info(self, _: web.Request) -> web.Response:
        self.model_info_calls += 1
        try:
            await self._wait_if_paused()
            if self.model_info_hangs:
                await self._resumed.wait()
        finally:
            self.model_info_ended += 1
        info = {"model": self.model, "block_size": self.block_size, "tokenizer": self.tokenizer,
                "instance_id": self.instance_id, "events_endpoint": None,
                "max_model_len": self.max_model_len}
        if self.max_num_seqs:
            info["capacity"] = {"max_num_seqs": self.max_num_seqs}
        return web.json_response({**info, **self.model_info_extra})

    async def _load(self, _: web.Request) -> web.Response:
        await self._wait_if_paused()
        if self.load_hangs:
            await self._resumed.wait()
        return web.Response(body=self.load_answer, content_type="application/json")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.began.set()
        self.headers.append(dict(request.headers))
        if self.mode == "refuse_unread":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        raw = await request.read()
        self.bodies.append(raw)
        body = json.loads(raw)
        self.requests.append(body)
        await self._wait_if_paused()
        if self.mode == "refuse":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        params = body.get("kv_transfer_params")
        if self.kv_load_failures and isinstance(params, dict) and params.get("do_remote_prefill"):
            self.kv_load_failures -= 1
            return web.json_response({"error": {"message": "KV load failure"}}, status=500)
        if self.mode == "reject":
            return web.json_response({"error": {"message": "too long",
                                                "code": "context_length_exceeded"}}, status=400)
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
                                                "prompt_tokens_details": {"cached_tokens": 0}},
                                      **self.answer_extra}, headers=self.answer_headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               **self.answer_headers})
        await response.prepare(request)
        if self.mode == "stall":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if self.mode == "fail_stream":
            await response.write(b'data: {"error": {"message": "the engine failed the request",'
                                 b' "type": "server_error", "code": 500}}\n\ndata: [DONE]\n\n')
            return response
        if self.mode == "die_mid_stream":
            await response.write(chunk)
            await response.write(chunk)
            assert request.transport is not None
            request.transport.abort()
            return response
        if self.mode == "paced":
            while await self._paced.get():
                await response.write(chunk)
            await response.write(b"data: [DONE]\n\n")
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
