"""Hostile clients and peers for the soak (``python -m bench.soak --hostile``).

Beside the soak's mixed traffic, each runs in a loop until the deadline and records what the
router answered:

- ``slow_body``: a chunked POST that sends one byte a second and never ends; the router must
  close it (408 or a closed connection) within its body deadlines, and the time it took is
  recorded;
- ``big_headers``: a request with 2 MB of headers; a 431 (or a closed connection) is due;
- ``image_fan_out``: a chat request naming 16 distinct 15 MB images on an allowed host (this
  module's image server, on 127.0.0.1, which the workers are told to allow); the worker must
  refuse it with a 4xx naming its limit, whatever the router makes of it;
- a stock-engine stand-in (``engine=vllm``) registered with the router, whose ``/metrics``
  grows by 2 MiB at every scrape up to 64 MiB and then starts small again (the router must
  mark it unhealthy past its answer limit, and healthy again after), and whose event port is a
  rogue publisher: valid batches with odd seqs (2**64 - 1, far ahead, backwards), bad frames
  and valid batches storing more blocks than the stand-in declares.

- ``smuggle``, ``transfer_fields``, ``duplicate_keys``, ``rank_header``: requests framed two
  ways (Content-Length beside Transfer-Encoding, two differing Content-Lengths, a coded
  Transfer-Encoding), bodies naming the router's own ``kv_transfer_params`` or SGLang's
  bootstrap fields, bodies repeating ``model`` or ``prompt``, and a client-set
  ``X-data-parallel-rank`` (:func:`boundary_probes`); a 400 (or a closed connection) is due
  for each but the last, which must be served (the header dropped).

The stand-in serves a model of its own (:data:`STOCK_MODEL`), so the soak's traffic never goes
there. What each produced is counted in :class:`Hostile`, printed after the soak's figures.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from indexer.wire import BlockStored, KVEventBatch, encode_batch, pack_seq
from kvroute.up import free_port

__all__ = ["STOCK_MODEL", "Hostile", "HostilePeers"]

STOCK_MODEL = "soak-stock"
IMAGE_BYTES = 15 * 1024 * 1024
IMAGES = 16
_PNG = b"\x89PNG\r\n\x1a\n"
_METRICS = (
    "vllm:num_requests_running 0\n"
    "vllm:num_requests_waiting 0\n"
    "vllm:kv_cache_usage_perc 0\n"
    'vllm:cache_config_info{block_size="32",num_gpu_blocks="4096"} 1\n'
)
_PAD_LINE = b"# " + b"x" * (64 * 1024 - 3) + b"\n"


@dataclass
class Hostile:
    """What the hostile clients and peers saw."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    slow_body_closed_s: list[float] = field(default_factory=list)
    metrics_scrapes: int = 0
    metrics_bytes_sent: int = 0
    image_gets: int = 0
    rogue_frames: int = 0
    #: The stand-in's entry in the router's ``GET /workers`` at the end of the run.
    stand_in: dict[str, object] = field(default_factory=dict)

    def report(self) -> list[str]:
        """The figures as lines."""
        lines = ["hostile clients and peers (kind, what came back, count):"]
        lines += [f"  {kind:<14} {answer:<30} {n}"
                  for (kind, answer), n in sorted(self.outcomes.items())]
        if self.slow_body_closed_s:
            closed = sorted(self.slow_body_closed_s)
            lines.append(f"  slow bodies closed after {closed[0]:.1f}-{closed[-1]:.1f}s")
        lines.append(f"  stock stand-in: {self.metrics_scrapes} metrics scrapes, "
                     f"{self.metrics_bytes_sent / 2**20:.0f} MiB sent before the router "
                     f"stopped reading; {self.rogue_frames} rogue event frames")
        lines.append(f"  image server: {self.image_gets} GETs")
        if self.stand_in:
            lines.append(f"  the router's view of the stand-in at the end: "
                         f"state {self.stand_in.get('state')}, "
                         f"last error {self.stand_in.get('last_error')!r}")
            lines.append(f"    counters {self.stand_in.get('counters')}")
        return lines


class HostilePeers:
    """The image server and the stock-engine stand-in with its rogue publisher."""

    def __init__(self, tally: Hostile) -> None:
        self.tally = tally
        self.http_port = free_port()
        self.events_port = free_port()
        self._runner: web.AppRunner | None = None
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)

    @property
    def stock_worker(self) -> str:
        """The router's ``--worker`` value for the stand-in."""
        return (f"http://127.0.0.1:{self.http_port},engine=vllm,"
                f"events=tcp://127.0.0.1:{self.events_port}")

    def image_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.http_port}/img/{i}.png"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/img/{i}.png", self._image)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.http_port).start()
        self._pub.bind(f"tcp://127.0.0.1:{self.events_port}")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self._pub.close(linger=0)
        self._context.term()

    async def _models(self, _: web.Request) -> web.Response:
        body = {"object": "list", "data": [{"id": STOCK_MODEL, "object": "model",
                                            "parent": None, "max_model_len": 2048}]}
        return web.json_response(body)

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.tally.metrics_scrapes += 1
        pad = (self.tally.metrics_scrapes * 2 * 2**20) % (64 * 2**20)
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            await response.write(_METRICS.encode())
            sent = 0
            while sent < pad:
                await response.write(_PAD_LINE)
                sent += len(_PAD_LINE)
                self.tally.metrics_bytes_sent += len(_PAD_LINE)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return response

    async def _image(self, request: web.Request) -> web.StreamResponse:
        self.tally.image_gets += 1
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        tag = int(request.match_info["i"]).to_bytes(2, "big")
        try:
            await response.write(_PNG)
            sent = len(_PNG)
            chunk = tag * (128 * 1024)
            while sent < IMAGE_BYTES:
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return response

    async def rogue(self, deadline: float, seed: int) -> None:
        """Publish odd seqs, bad frames and over-capacity batches until ``deadline``."""
        rng = random.Random(seed)
        seq = 0
        block = 0
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.5:
                frames = [b"", pack_seq(seq), _stored(range(block, block + 4))]
                seq, block = seq + 1, block + 4
            elif roll < 0.6:
                frames = [b"", b"\xff" * 8, _stored([block])]
            elif roll < 0.7:
                frames = [b"", pack_seq(seq + rng.randrange(100, 10**6)), _stored([block])]
            elif roll < 0.75:
                frames = [b"", pack_seq(max(0, seq - rng.randrange(1, 50))), _stored([block])]
            elif roll < 0.9:
                frames = rng.choice([[b"x"], [b"", pack_seq(seq)], [b"", pack_seq(seq), b"\xc1"],
                                     [b"", b"\x01" * 7, _stored([block])]])
            else:  # more than the 4,096 blocks the stand-in declares, in one batch
                frames = [b"", pack_seq(seq), _stored(range(block, block + 5000))]
                seq, block = seq + 1, block + 5000
            await self._pub.send_multipart(frames)
            self.tally.rogue_frames += 1
            await asyncio.sleep(0.05)


def _stored(blocks: range | list[int]) -> bytes:
    events = [BlockStored(block_hashes=[b], parent_block_hash=None, token_ids=[b] * 32,
                          block_size=32, lora_id=None, medium="GPU", lora_name=None,
                          group_idx=0) for b in blocks]
    return encode_batch(KVEventBatch(time.time(), list(events), 0))


async def _raw(port: int, head: bytes, trickle: bool = False, deadline: float = 0.0
               ) -> tuple[str, float]:
    """Send ``head`` (then, when ``trickle``, a one-byte chunk a second until an answer or
    ``deadline``) and read the status line; returns it (or how the connection ended) and the
    seconds it took."""
    started = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), 5)
    except (OSError, TimeoutError) as exc:
        return f"connect failed: {type(exc).__name__}", 0.0
    try:
        writer.write(head)
        await writer.drain()
        read = asyncio.ensure_future(reader.readline())
        while trickle and not read.done() and time.monotonic() < deadline:
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.wait([read], timeout=1.0)
        if trickle and not read.done():
            read.cancel()
            return "still open at the end of the run", time.monotonic() - started
        line = await asyncio.wait_for(read, 30)
        answer = line.decode("latin-1").split(" ")[1] if line else "closed"
    except (ConnectionError, TimeoutError, IndexError) as exc:
        answer = f"closed ({type(exc).__name__})"
    finally:
        writer.close()
    return answer, time.monotonic() - started


async def slow_bodies(port: int, deadline: float, tally: Hostile) -> None:
    """Chunked POSTs that send one byte a second, one after the other, until ``deadline``."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    while time.monotonic() < deadline:
        answer, took = await _raw(port, head, trickle=True, deadline=deadline)
        tally.outcomes[("slow_body", answer)] += 1
        if answer != "still open at the end of the run":
            tally.slow_body_closed_s.append(took)


async def big_headers(port: int, deadline: float, tally: Hostile) -> None:
    """Requests with 2 MB of headers, one every second, until ``deadline``."""
    filler = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"y" * 8000) for i in range(256))
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + filler + b"\r\n"
    while time.monotonic() < deadline:
        answer, _ = await _raw(port, head)
        tally.outcomes[("big_headers", answer)] += 1
        await asyncio.sleep(1.0)


#: (kind, raw request) pairs of :func:`boundary_probes`; each framed body is a valid completion.
_BODY = b'{"model": "kvroute-sim", "prompt": "hi", "max_tokens": 1}'
_PROBES: list[tuple[str, bytes]] = [
    ("smuggle", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
     b"\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
     % (len(_BODY), len(_BODY), _BODY)),
    ("smuggle", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
     b"\r\nContent-Length: %d\r\nContent-Length: 5\r\n\r\n%s" % (len(_BODY), _BODY)),
    ("smuggle", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
     b"\r\nTransfer-Encoding: gzip, chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
     % (len(_BODY), _BODY)),
]
_BODIES: list[tuple[str, bytes, dict[str, str]]] = [
    ("transfer_fields", b'{"model": "kvroute-sim", "prompt": "hi", "max_tokens": 1, '
     b'"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "127.0.0.9"}}', {}),
    ("transfer_fields", b'{"model": "kvroute-sim", "prompt": "hi", "max_tokens": 1, '
     b'"bootstrap_host": "127.0.0.9", "bootstrap_room": 7}', {}),
    ("duplicate_keys", b'{"model": "kvroute-sim", "prompt": "hi", "prompt": "other", '
     b'"max_tokens": 1}', {}),
    ("rank_header", _BODY, {"X-data-parallel-rank": "7"}),
]


async def boundary_probes(base: str, port: int, deadline: float, tally: Hostile) -> None:
    """The module docstring's boundary probes, one round a second, until ``deadline``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while time.monotonic() < deadline:
            for kind, head in _PROBES:
                answer, _ = await _raw(port, head)
                tally.outcomes[(kind, answer)] += 1
            for kind, body, headers in _BODIES:
                try:
                    async with session.post(base + "/v1/completions", data=body, headers={
                            "Content-Type": "application/json", **headers}) as r:
                        await r.read()
                        answer = str(r.status)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    answer = f"no answer: {type(exc).__name__}"
                tally.outcomes[(kind, answer)] += 1
            await asyncio.sleep(1.0)


async def image_fan_out(base: str, peers: HostilePeers, deadline: float, tally: Hostile
                        ) -> None:
    """One chat request naming 16 distinct 15 MB images every 2 s, until ``deadline``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await _fan_out(session, base, peers, deadline, tally)


async def _fan_out(session: aiohttp.ClientSession, base: str, peers: HostilePeers,
                   deadline: float, tally: Hostile) -> None:
    n = 0
    while time.monotonic() < deadline:
        parts: list[dict[str, object]] = [{"type": "text", "text": "describe these"}]
        parts += [{"type": "image_url", "image_url": {"url": peers.image_url(n * IMAGES + i)}}
                  for i in range(IMAGES)]
        body = {"model": "kvroute-sim", "max_tokens": 4,
                "messages": [{"role": "user", "content": parts}]}
        n += 1
        try:
            async with session.post(base + "/v1/chat/completions", data=json.dumps(body),
                                    headers={"Content-Type": "application/json"}) as r:
                status = r.status
                await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            tally.outcomes[("image_fan_out", f"no answer: {type(exc).__name__}")] += 1
        else:
            tally.outcomes[("image_fan_out", str(status))] += 1
        await asyncio.sleep(2.0)


async def read_stand_in(base: str, peers: HostilePeers, tally: Hostile) -> None:
    """Keep the stand-in's entry of the router's ``GET /workers`` in ``tally``."""
    url = f"http://127.0.0.1:{peers.http_port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session, \
                session.get(base + "/workers") as r:
            workers = (await r.json())["workers"]
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
        tally.stand_in = {"state": f"unknown ({type(exc).__name__})"}
        return
    tally.stand_in = next((w for w in workers if w.get("url") == url), {})
