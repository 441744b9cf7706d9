"""The endpoint picker's cost: Envoy + ``kvroute epp`` against a worker directly and against
the HTTP router.

One sim worker answers every path (``max_tokens`` 1, a huge ``--speedup``: the worker costs
almost nothing), so the differences are the front door's. Three paths to the same worker:

- ``direct``: the client talks to the worker;
- ``router``: ``kvroute router`` decides and proxies;
- ``epp``: Envoy (the shipped ``deploy/envoy/envoy.yaml``, one worker thread) asks ``kvroute
  epp`` over ext_proc (headers + buffered body), then forwards to the worker it named.

Figures, all with 16 connections kept busy (closed loop): latency p50/p99 per path and the
added latency (path minus direct), requests per second per path, and the EPP process's CPU
seconds per request from ``/proc``; the same added latency over one connection (requests one
after another); and ``exchange_cpu_us_per_request``, the EPP's own work per request without
gRPC (parse, decide, book, answer, release), measured in this process. On a machine where
the client, Envoy, the EPP and the worker share a few cores, the chain's requests per second
is bounded by all of them together;
``epp_rps_per_core`` (requests divided by the EPP's CPU seconds) is what one EPP process
handles when it has a core to itself. ``wrk`` is the load generator when installed (its
``--latency`` percentiles), else aiohttp (slower: it takes CPU from the servers).

CPU per request is the figure to compare changes by: on a busy machine latency and requests
per second swing with the neighbours, CPU time per request much less. It still varies from
run to run (more wake-ups per request when the process is starved), so the run ends with
``--rounds`` alternating runs of the EPP and of :mod:`bench.ext_proc_floor`, a do-nothing
ext_proc server on the same runtime behind its own Envoy, and prints the medians
(``epp_cpu_us_per_request_median``, ``floor_cpu_us_per_request_median``). The floor is most of
the EPP's cost: grpcio's asyncio server hands every completion of a call from its polling
thread to the event loop, some forty system calls per request (eventfd writes, socket reads,
epoll waits, futexes) around two ``sendmsg`` and two ``recvmsg`` of traffic. The
conversation is already the shortest that routes (request headers and buffered body; see
``deploy/envoy/envoy.yaml``); grpcio's synchronous server costs more than the asyncio one for
the same do-nothing work. More decisions per second come from more EPP processes.

``--bodies`` measures large bodies instead: first-time completion prompts of 100 KB and
400 KB of generated text, tokenized by :mod:`bench.prompts`' 32k BPE (built once under
``bench-out/prompts``), one request at a time to a fixed-answer worker in this process (it
reads the body and answers at once: a real worker's own tokenizing would swamp the
gateway's cost): directly, through Envoy with a buffered EPP, and through Envoy with a
streamed (``FULL_DUPLEX_STREAMED``) EPP, both EPPs under ``--tokenize match``. The added
latency is paired (each round's path minus the same round's direct request). The buffered
EPP decides after the body's last byte, then Envoy copies the body to the worker; the
streamed one decides after the first 8-16 KB (a first-time prompt's match ends in its first
block) and the body flows on to the worker while the rest arrives, at the price of every
chunk's round trip through the EPP. ``--upload-mbps M`` paces the client as a network link
would; at 100 Mbit/s streamed added less than buffered on 400 KB (3.6-5.3 against 8.8-9.9
ms, saving 1.4-5.6 ms paired: at least the buffered EPP's gRPC side of the request, 2-2.5 ms
of its CPU, most of it receiving the body as one message) and on 100 KB (3.9-5.5 against
6.0-7.8 ms), while on unpaced loopback it added about as much or more (9.9 against 9.4 ms
on 400 KB): there the chunks' gRPC trips cost about what one decision on the whole body
does. ``*_in_process_cpu_ms`` is the EPP's own work without gRPC: streamed reads the JSON as
it arrives and decides on the prompt so far (to learn whether its match is settled), then
with the rest's length, 2.2-3.1 ms on 400 KB against 2.0-2.1 ms buffered. Figures and
commands: docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.envoy import envoy_command, render_envoy_config
from bench.figures import percentile, print_figures
from bench.http_load import latency, run_wrk, spawn, stop, wait_ready
from kvroute.up import free_port

BODY = {"model": "kvroute-sim", "prompt": "a small prompt for the picker", "max_tokens": 1}
CONNECTIONS = 16


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _closed_loop(url: str, requests: int) -> tuple[list[float], float, int]:
    connector = aiohttp.TCPConnector(limit=CONNECTIONS)
    times: list[float] = []
    failed = 0
    remaining = requests

    async def loop(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, failed
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            async with session.post(url, json=BODY) as r:
                await r.read()
                failed += r.status != 200
            times.append(time.perf_counter() - started)

    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(loop(session) for _ in range(CONNECTIONS)))
        elapsed = time.perf_counter() - started
    return times, len(times) / elapsed, failed


_WRK_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def _wrk(url: str, seconds: float) -> tuple[float, float, float]:
    """(p50 s, p99 s, requests/s) measured by wrk with 16 connections."""
    out, rps = run_wrk(url, BODY, CONNECTIONS, seconds, "--latency")

    def pct(q: str) -> float:
        found = re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert found, f"no {q}% line in wrk's output:\n{out}"
        return float(found.group(1)) * _WRK_UNITS[found.group(2)]

    return pct("50"), pct("99"), rps


def _measure(url: str, requests: int, seconds: float) -> dict[str, float]:
    one = latency(url, BODY, min(requests, 1000), warmup=100)
    return {**_loaded(url, requests, seconds), "one_p50": percentile(one, 50),
            "one_p99": percentile(one, 99)}


def _loaded(url: str, requests: int, seconds: float) -> dict[str, float]:
    """p50, p99 and requests/s with 16 connections: wrk where installed, else asyncio."""
    if shutil.which("wrk"):
        p50, p99, rps = _wrk(url, seconds)
    else:
        times, rps, failed = asyncio.run(_closed_loop(url, requests))
        if failed:
            raise RuntimeError(f"{failed} requests to {url} failed")
        p50, p99 = percentile(times, 50), percentile(times, 99)
    return {"p50": p50, "p99": p99, "rps": rps}


def _measure_epp(url: str, requests: int, seconds: float, pid: int
                 ) -> tuple[dict[str, float], float, float]:
    """The Envoy + EPP path's figures, and the EPP's CPU seconds and the wall seconds of the
    16-connection part alone."""
    one = latency(url, BODY, min(requests, 1000), warmup=100)
    cpu_before, started = _cpu_seconds(pid), time.perf_counter()
    figures = _loaded(url, requests, seconds)
    elapsed, cpu = time.perf_counter() - started, _cpu_seconds(pid) - cpu_before
    return ({**figures, "one_p50": percentile(one, 50), "one_p99": percentile(one, 99)},
            cpu, elapsed)


def _cpu_us_per_request(url: str, pid: int, requests: int, seconds: float) -> float:
    """CPU microseconds of process ``pid`` per request, over one closed-loop run at ``url``."""
    cpu_before = _cpu_seconds(pid)
    if shutil.which("wrk"):
        served = _wrk(url, seconds)[2] * seconds
    else:
        times, _, failed = asyncio.run(_closed_loop(url, requests))
        if failed:
            raise RuntimeError(f"{failed} requests to {url} failed")
        served = len(times)
    return (_cpu_seconds(pid) - cpu_before) / served * 1e6


def _wait_grpc_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvroute epp exited with {proc.returncode}")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"kvroute epp was not ready in {timeout}s")


def run(requests: int, seconds: float, rounds: int = 3) -> dict[str, Any]:
    """Start the worker, router, EPP, the ext_proc floor and an Envoy in front of each;
    measure the three paths, then the EPP's and the floor's CPU per request in ``rounds``
    alternating runs; stop everything."""
    worker_port, router_port, epp_port = free_port(), free_port(), free_port()
    envoy_port, admin_port = free_port(), free_port()
    floor_port, floor_envoy_port, floor_admin_port = free_port(), free_port(), free_port()
    worker_url = f"http://127.0.0.1:{worker_port}"
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "envoy.yaml"
        config.write_text(render_envoy_config(envoy_port, admin_port, epp_port))
        floor_config = Path(scratch) / "floor.yaml"
        floor_config.write_text(render_envoy_config(floor_envoy_port, floor_admin_port,
                                                     floor_port))
        try:
            _step("starting a worker, the router, the EPP and Envoy")
            procs.append(spawn(["worker", "--port", str(worker_port), "--events-port",
                                str(free_port()), "--replay-port", str(free_port()),
                                "--speedup", "1e9"], worker_url))
            procs.append(spawn(["router", "--port", str(router_port), "--worker", worker_url],
                               f"http://127.0.0.1:{router_port}", health="/ready"))
            epp = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "epp", "--grpc-port",
                                    str(epp_port), "--worker", worker_url, "--log-level",
                                    "warning"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
            procs.append(epp)
            _wait_grpc_ready(epp_port, epp)
            procs.append(spawn_envoy(config, admin_port))
            _step("measuring the direct path")
            direct = _measure(f"{worker_url}/v1/completions", requests, seconds)
            _step("measuring the router path")
            routed = _measure(f"http://127.0.0.1:{router_port}/v1/completions", requests,
                              seconds)
            epp_url = f"http://127.0.0.1:{envoy_port}/v1/completions"
            _step("measuring the EPP path")
            picked, epp_cpu, elapsed = _measure_epp(epp_url, requests, seconds, epp.pid)
            floor = subprocess.Popen([sys.executable, "-m", "bench.ext_proc_floor",
                                      "--grpc-port", str(floor_port), "--endpoint",
                                      f"127.0.0.1:{worker_port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
            procs.append(floor)
            _wait_grpc_ready(floor_port, floor)
            procs.append(spawn_envoy(floor_config, floor_admin_port))
            floor_url = f"http://127.0.0.1:{floor_envoy_port}/v1/completions"
            latency(floor_url, BODY, 100, warmup=0)  # Envoy's connections are open
            epp_rounds, floor_rounds = [], []
            for i in range(rounds):  # alternating: a busy machine weighs on both alike
                _step(f"CPU round {i + 1} of {rounds}: the EPP, then the do-nothing floor")
                epp_rounds.append(_cpu_us_per_request(epp_url, epp.pid, requests, seconds))
                floor_rounds.append(_cpu_us_per_request(floor_url, floor.pid, requests,
                                                        seconds))
        finally:
            for proc in reversed(procs):
                stop(proc)
    served = picked["rps"] * seconds if shutil.which("wrk") else requests
    ms = 1e3
    return {
        "one_connection_direct_p50_ms": round(direct["one_p50"] * 1e3, 3),
        "one_connection_router_added_p50_ms": round((routed["one_p50"] - direct["one_p50"])
                                                    * 1e3, 3),
        "one_connection_epp_added_p50_ms": round((picked["one_p50"] - direct["one_p50"])
                                                 * 1e3, 3),
        "one_connection_epp_added_p99_ms": round((picked["one_p99"] - direct["one_p99"])
                                                 * 1e3, 3),
        "connections": CONNECTIONS,
        "load_generator": "wrk" if shutil.which("wrk") else "aiohttp",
        "direct_p50_ms": round(direct["p50"] * ms, 3),
        "direct_p99_ms": round(direct["p99"] * ms, 3),
        "router_p50_ms": round(routed["p50"] * ms, 3),
        "router_p99_ms": round(routed["p99"] * ms, 3),
        "epp_p50_ms": round(picked["p50"] * ms, 3),
        "epp_p99_ms": round(picked["p99"] * ms, 3),
        "router_added_p50_ms": round((routed["p50"] - direct["p50"]) * ms, 3),
        "router_added_p99_ms": round((routed["p99"] - direct["p99"]) * ms, 3),
        "epp_added_p50_ms": round((picked["p50"] - direct["p50"]) * ms, 3),
        "epp_added_p99_ms": round((picked["p99"] - direct["p99"]) * ms, 3),
        "direct_rps": round(direct["rps"]),
        "router_rps": round(routed["rps"]),
        "epp_path_rps": round(picked["rps"]),
        "epp_cpu_us_per_request": round(epp_cpu / served * 1e6, 1),
        "epp_rps_per_core": round(served / epp_cpu) if epp_cpu else None,
        "epp_cpu_share": round(epp_cpu / elapsed, 2),
        "epp_cpu_us_per_request_median": round(statistics.median(epp_rounds), 1),
        "floor_cpu_us_per_request_median": round(statistics.median(floor_rounds), 1),
        "cpu_rounds": rounds,
        "cpus": os.cpu_count(),
    }


def _step(what: str) -> None:
    """A progress line on stderr (the figures go to stdout at the end)."""
    print(f"bench.epp: {what}", file=sys.stderr, flush=True)


def spawn_envoy(config: Path, admin_port: int, timeout: float = 30
                ) -> subprocess.Popen[bytes]:
    """Start Envoy with ``config`` and wait until its admin port says it is ready."""
    proc = subprocess.Popen(envoy_command(config), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    return wait_ready(proc, f"http://127.0.0.1:{admin_port}/ready", "envoy", timeout)


def exchange_cpu_us(requests: int = 3000) -> float:
    """CPU microseconds per request of the EPP's own work, no transport: one ext_proc
    exchange (headers, buffered body: parse, decide, book, answer; then release) against a
    RouterService with three adopted workers."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from router.epp.exchange import Exchange
    from router.epp.picker import Picker
    from router.fleet.worker_table import WorkerInfo
    from router.service import RouterService
    from router.settings import RouterSettings

    service = RouterService(RouterSettings(seed=1), httpx.AsyncClient())
    for w in range(3):
        service.registry.adopt(WorkerInfo(url=f"http://10.0.0.{w + 1}:8000",
                                          model="kvroute-sim", block_size=32,
                                          tokenizer="bytes-v1", instance_id=f"i{w}",
                                          max_model_len=100_000))
    picker = Picker(service)
    headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")])))
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps(BODY).encode(),
                                                         end_of_stream=True))
    started = time.process_time()
    for _ in range(requests):
        exchange = Exchange(picker)
        exchange.on_message(headers)
        exchange.on_message(body)
        exchange.close()
    return (time.process_time() - started) / requests * 1e6


class _FixedWorker:
    """A worker that reads each body and answers a fixed completion at once, in a thread of
    its own: with large bodies a real worker's own tokenizing would swamp the front door's
    cost. It names ``tokenizer`` as its tokenizer, so the EPP takes it."""

    def __init__(self, tokenizer: str) -> None:
        self.port = free_port()
        self._tokenizer = tokenizer
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    def __enter__(self) -> _FixedWorker:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fixed-answer worker did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _serve(self) -> None:
        from aiohttp import web

        info = {"model": "kvroute-sim", "block_size": 32, "tokenizer": self._tokenizer,
                "instance_id": "fixed-1", "events_endpoint": None, "max_model_len": 1 << 22}
        answer = {"id": "c", "object": "text_completion", "model": "kvroute-sim",
                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}

        async def complete(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response(answer)

        def fixed(value: dict[str, Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
            async def handler(_: web.Request) -> web.Response:
                return web.json_response(value)
            return handler

        app = web.Application(client_max_size=1 << 24)
        app.router.add_get("/model_info", fixed(info))
        app.router.add_get("/load", fixed({"running": 0, "waiting": 0}))
        app.router.add_post("/v1/completions", complete)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()


#: The large-body sizes of ``--bodies`` (bytes of prompt).
BODY_SIZES = {"100KB": 100_000, "400KB": 400_000}


def _envoy_for(scratch: Path, name: str, epp_port: int, streamed: bool
               ) -> tuple[Path, int, int]:
    """An Envoy config in front of ``epp_port``: (path, listener port, admin port)."""
    port, admin = free_port(), free_port()
    config = render_envoy_config(port, admin, epp_port)
    if streamed:  # as e2e.gateway.Envoy does: the body to the EPP chunk by chunk
        config = config.replace("request_body_mode: BUFFERED",
                                "request_body_mode: FULL_DUPLEX_STREAMED").replace(
                                "request_trailer_mode: SKIP", "request_trailer_mode: SEND")
    path = scratch / f"{name}.yaml"
    path.write_text(config)
    return path, port, admin


def _in_process_ms(folder: Path, raw: bytes, streamed: bool, n: int = 9) -> float:
    """Median CPU milliseconds of the EPP's own work on ``raw`` (first-time prompts), no
    transport: one exchange, buffered (one message) or streamed (16 KB chunks)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from router.epp.exchange import Exchange
    from router.epp.picker import Picker
    from router.fleet.worker_table import WorkerInfo
    from router.service import RouterService
    from router.settings import RouterSettings

    service = RouterService(RouterSettings(seed=1, tokenizer=str(folder), tokenize="match"),
                            httpx.AsyncClient())
    service.registry.adopt(WorkerInfo(url="http://10.0.0.1:8000", model="kvroute-sim",
                                      block_size=32, tokenizer=service.tokenizer.identity,
                                      instance_id="i0", max_model_len=1 << 20))
    values = [base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
              base_pb2.HeaderValue(key="content-length", raw_value=str(len(raw)).encode())]
    times = []
    for k in range(n):
        body = raw.replace(b"FIRST", str(k).encode().rjust(5, b"0"), 1)
        headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=values)))
        if streamed:
            headers.protocol_config.request_body_mode = \
                processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
        step = 16384 if streamed else len(body)
        chunks = [ep.ProcessingRequest(request_body=ep.HttpBody(
            body=body[i:i + step], end_of_stream=i + step >= len(body)))
            for i in range(0, len(body), step)]
        started = time.process_time()
        exchange = Exchange(Picker(service))
        exchange.on_message(headers)
        for chunk in chunks:
            exchange.on_message(chunk)
        times.append(time.process_time() - started)
        exchange.close()
    return statistics.median(times) * 1e3


def _paced(body: bytes, mbps: float) -> Iterator[bytes]:
    """``body`` in 16 KB pieces at about ``mbps`` megabits per second (a client's uplink)."""
    step, started = 16384, time.perf_counter()
    for at in range(0, len(body), step):
        wait = started + at * 8 / (mbps * 1e6) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        yield body[at:at + step]


def large_bodies(n: int, mbps: float | None = None) -> dict[str, Any]:
    """Completion bodies of 100 KB and 400 KB, first-time prompts of generated text tokenized
    by :mod:`bench.prompts`' 32k BPE, one at a time to a fixed-answer worker: directly, through
    Envoy and a buffered EPP, and through Envoy and a streamed (full-duplex) EPP, ``n``
    requests per size and path, the paths alternating; each EPP under ``--tokenize match``.
    ``mbps``: the client sends each body at that rate (with its ``content-length``), as over
    a network link; ``None``: as fast as loopback takes it."""
    from bench.prompts import Language, tokenizer_dir
    from openai_request.tokenizer import load_tokenizer

    folder = tokenizer_dir()
    buffered_port, streamed_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    figures: dict[str, Any] = {}
    lang = Language(7)
    with (tempfile.TemporaryDirectory() as scratch,
          _FixedWorker(load_tokenizer(str(folder)).identity) as worker):
        worker_url = f"http://127.0.0.1:{worker.port}"
        try:
            urls = {"direct": f"{worker_url}/v1/completions"}
            epps = {}
            for name, port in (("buffered", buffered_port), ("streamed", streamed_port)):
                epp = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "epp",
                                        "--grpc-port", str(port), "--worker", worker_url,
                                        "--tokenizer", str(folder), "--tokenize", "match",
                                        "--log-level", "warning"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
                procs.append(epp)
                epps[name] = epp
                _wait_grpc_ready(port, epp)
                config, listen, admin = _envoy_for(Path(scratch), name, port,
                                                   name == "streamed")
                procs.append(spawn_envoy(config, admin))
                urls[name] = f"http://127.0.0.1:{listen}/v1/completions"
            with httpx.Client(timeout=120) as client:
                for label, size in BODY_SIZES.items():
                    raw = json.dumps({"model": "kvroute-sim", "max_tokens": 1,
                                      "prompt": "FIRST " + lang.text(size)}).encode()
                    times: dict[str, list[float]] = {p: [] for p in urls}
                    cpu = {p: 0.0 for p in epps}
                    for k in range(n + 1):  # the first round warms connections, not counted
                        for path, url in urls.items():
                            body = raw.replace(b"FIRST", f"{label}{k}{path}".encode(), 1)
                            before = _cpu_seconds(epps[path].pid) if path in epps else 0.0
                            started = time.perf_counter()
                            reply = client.post(
                                url, content=body if mbps is None else _paced(body, mbps),
                                headers={"content-type": "application/json",
                                         "content-length": str(len(body))})
                            elapsed = time.perf_counter() - started
                            if reply.status_code != 200:
                                raise RuntimeError(f"{path} answered {reply.status_code}: "
                                                   f"{reply.text[:300]}")
                            if k:
                                times[path].append(elapsed)
                                if path in epps:
                                    cpu[path] += _cpu_seconds(epps[path].pid) - before
                    # Paired: each round's path minus the same round's direct request, so
                    # the machine's swings mostly cancel.
                    added = {p: [(a - d) * 1e3 for a, d in zip(times[p], times["direct"],
                                                                strict=True)] for p in epps}
                    figures[f"{label}_direct_p50_ms"] = round(
                        statistics.median(times["direct"]) * 1e3, 2)
                    for path in epps:
                        figures[f"{label}_{path}_added_p50_ms"] = round(
                            statistics.median(added[path]), 2)
                        figures[f"{label}_{path}_epp_cpu_ms_per_request"] = round(
                            cpu[path] / n * 1e3, 2)
                        figures[f"{label}_{path}_in_process_cpu_ms"] = round(
                            _in_process_ms(folder, raw, path == "streamed"), 2)
                    figures[f"{label}_streamed_saves_ms"] = round(statistics.median(
                        [(b - s) * 1e3 for b, s in zip(times["buffered"], times["streamed"],
                                                       strict=True)]), 2)
        finally:
            for proc in reversed(procs):
                stop(proc)
    figures["bodies_requests_per_size_and_path"] = n
    figures["bodies_client_mbps"] = mbps if mbps is not None else "loopback"
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small, fast run")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="seconds per path under wrk (default 10)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating EPP / floor runs for the CPU medians (default 3)")
    parser.add_argument("--bodies", action="store_true",
                        help="only the 100 KB and 400 KB bodies, buffered against streamed")
    parser.add_argument("--body-requests", type=int, default=20,
                        help="requests per body size and path with --bodies (default 20)")
    parser.add_argument("--upload-mbps", type=float,
                        help="with --bodies: the client's send rate (default: unpaced)")
    args = parser.parse_args(argv)
    if args.bodies:
        print_figures(large_bodies(max(1, args.body_requests), args.upload_mbps), args.json)
        return
    seconds = 2.0 if args.quick else args.seconds
    _step("the EPP's own work per request, in this process")
    figures = {"exchange_cpu_us_per_request": round(exchange_cpu_us(), 1)}
    figures |= run(500 if args.quick else 5000, seconds, max(1, args.rounds))
    print_figures(figures, args.json)


if __name__ == "__main__":
    main()
