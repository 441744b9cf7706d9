"""Peer KV fetch, the receiver's side: take a prompt's leading blocks from the worker that
holds them, before the request runs.

A router that sends a request here rather than to the worker holding its prefix may say
where the prefix is (request headers)::

    x-kvroute-fetch-source: http://127.0.0.1:8102     the holder's base URL
    x-kvroute-fetch-blocks: 12                        leading full blocks it holds
    x-kvroute-transfer-token: <secret>                when a secret is configured

When :mod:`workers.http.transfer_auth` trusts the instruction, :meth:`PeerFetcher.fetch`
keys the prompt (:mod:`workers.cache.block_keys`), skips the leading blocks this worker holds
already (either tier), and posts the keys of the rest, at most as many as the instruction
names and never the block holding the prompt's last token, to the holder's
``POST /kv_transfer/read`` (:mod:`workers.http.kv_read`). The answer's blocks enter this
worker's cache through :meth:`~workers.engine.loop.Engine.receive_blocks`, which publishes
them as stored (a router learns of them from this worker's events); the request then finds
them cached. The torch engine writes the bytes of the :mod:`workers.torch.kv_wire` message;
the sim engine, told only how many blocks the holder has, waits the modelled transfer time
``blocks * block_size * kv_bytes_per_token / kv_transfer_bandwidth / speedup`` instead.
Between two torch workers on one GPU the blocks are copied device to device over CUDA IPC
instead (:mod:`workers.http.kv_ipc`); any failure of that path makes the same fetch read the
bytes over HTTP.

Every failure costs only time: the request computes what was not fetched. Each is a
:class:`FetchResult` with a short reason, counted, and logged once per reason:

==================  ==========================================================================
``untrusted``       the instruction is not authenticated (:mod:`workers.http.transfer_auth`)
``bad_instruction`` malformed instruction headers
``unreachable``     the holder cannot be reached, or its answer was cut off
``status_<code>``   the holder answered an HTTP error (401: another secret; 503: its read slots
                    are busy, or it holds the blocks but may pin none without those its waiting
                    requests need)
``bad_message``     an answer that does not decode (another block layout, cut short, too long)
``missing``         the holder holds none of the named blocks on its device (evicted since the
                    router heard of them, say)
``timeout``         the fetch outlived ``kv_fetch_timeout`` (waiting for one of
                    ``kv_fetch_concurrency`` slots included)
``no_free_blocks``  too few free blocks here to take the KV
``evicted``         blocks this worker held when it asked were evicted before the answer
``error``           anything else (a bug: logged with its traceback)
==================  ==========================================================================

The answer carries ``x-kvroute-fetch-result`` (:meth:`FetchResult.header`):
``blocks=<n>;bytes=<b>;seconds=<s>`` (n is 0 when every named block was here already:
skipped) or ``failed;reason=<reason>``.

A worker advertises the bytes a second its HTTP fetches move (``kv_fetch``'s
``http_bandwidth`` in ``/model_info``, :func:`http_bandwidth`), which a router prices a
pair's first fetch at before it has a result of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from workers.cache.block_keys import BlockKey, Prompt, RequestBlocks
from workers.engine.loop import Engine
from workers.http import kv_pull
from workers.http.kv_ipc import (
    OPEN_PATH,
    RELEASE_PATH,
    TRANSFER,
    IpcPeers,
    MappedPool,
    PinLeaseEnded,
    ipc_writer,
    parse_open_answer,
    parse_read_answer,
)
from workers.http.kv_pull import PeerRefused, PeerUnreachable, fetch_body, message_writer
from workers.http.kv_read import MAX_READ_BLOCKS
from workers.settings import WorkerSettings
from workers.torch.kv_wire import TransferError, decode, max_message_bytes

__all__ = ["BLOCKS_HEADER", "HTTP_FETCH_BANDWIDTH", "RESULT_HEADER", "SOURCE_HEADER",
           "FetchInstruction", "FetchResult", "PeerFetcher", "http_bandwidth",
           "parse_instruction"]

log = logging.getLogger(__name__)

#: Bytes a second a torch worker's fetch moves over HTTP, the holder's encoding and the
#: receiver's decoding and copy included: 0.25 GB/s, between the 0.20 of a 64-block fetch
#: and the 0.30 of 256 or more (``llama-1b``'s 1 MiB blocks, two workers of one H200 host,
#: ``docs/gpu.md``, "Peer KV fetch between workers on one GPU").
HTTP_FETCH_BANDWIDTH = 0.25e9
#: The most a worker advertises, and the bound a router's /model_info schema accepts: far beyond
#: any real link, but a sim worker's modelled transfer scales with ``speedup`` (25 GB/s at
#: ``speedup`` 1e6 is 2.5e16 B/s).
MAX_ADVERTISED_BANDWIDTH = 1e18


def http_bandwidth(settings: WorkerSettings, torch_engine: bool) -> float:
    """The bytes a second this worker advertises its HTTP fetches move: the operator's
    ``kv_fetch_bandwidth``, else the torch engine's :data:`HTTP_FETCH_BANDWIDTH`, else the
    sim engine's modelled transfer (``kv_transfer_bandwidth`` times ``speedup``), at most
    :data:`MAX_ADVERTISED_BANDWIDTH`."""
    if settings.kv_fetch_bandwidth > 0:
        figure = settings.kv_fetch_bandwidth
    elif torch_engine:
        figure = HTTP_FETCH_BANDWIDTH
    else:
        figure = settings.kv_transfer_bandwidth * settings.speedup
    return min(figure, MAX_ADVERTISED_BANDWIDTH)

SOURCE_HEADER = "x-kvroute-fetch-source"
BLOCKS_HEADER = "x-kvroute-fetch-blocks"
RESULT_HEADER = "x-kvroute-fetch-result"

#: The answer of a sim engine's read is ``{"blocks": n}``: a few bytes.
_SIM_ANSWER_BYTES = 1024
#: An IPC open's or read's JSON answer: a handle, or up to MAX_READ_BLOCKS block ids.
_IPC_ANSWER_BYTES = MAX_READ_BLOCKS * 12 + 65536


@dataclass(frozen=True, slots=True)
class FetchInstruction:
    """Where a request's leading blocks are: the holder's base URL and how many it holds."""

    source: str
    blocks: int


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What one fetch did: ``blocks`` received (``moved_bytes`` in ``seconds``, over
    ``transfer``: ``http`` or ``cuda_ipc``), or why it failed (``failure``, a short token;
    the request computed the blocks itself)."""

    blocks: int = 0
    moved_bytes: int = 0
    seconds: float = 0.0
    failure: str | None = None
    transfer: str = "http"
    #: Why the CUDA IPC path was left for HTTP in this fetch (None: it was not).
    ipc_fallback: str | None = None

    @property
    def outcome(self) -> str:
        """``fetched``, ``skipped`` (nothing to fetch) or ``failed``."""
        if self.failure is not None:
            return "failed"
        return "fetched" if self.blocks else "skipped"

    def header(self) -> str:
        """The ``x-kvroute-fetch-result`` value (module docstring)."""
        if self.failure is not None:
            return f"failed;reason={self.failure}"
        return f"blocks={self.blocks};bytes={self.moved_bytes};seconds={self.seconds:.6f}"


def parse_instruction(headers: Mapping[str, str]) -> FetchInstruction | None:
    """The fetch instruction in ``headers``, or None when they carry none.

    Raises:
        ValueError: a malformed instruction (the message says which header and why).
    """
    source, blocks = headers.get(SOURCE_HEADER), headers.get(BLOCKS_HEADER)
    if source is None and blocks is None:
        return None
    if source is None or blocks is None:
        raise ValueError(f"a fetch instruction needs both {SOURCE_HEADER} and {BLOCKS_HEADER}")
    try:
        parts = urlsplit(source.strip())
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        raise ValueError(f"{SOURCE_HEADER} {source!r} is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{SOURCE_HEADER} must be a worker's base URL (http://host:port), "
                         f"got {source!r}")
    if not blocks.strip().isdigit() or not 0 < int(blocks) <= MAX_READ_BLOCKS:
        raise ValueError(f"{BLOCKS_HEADER} must be a count in 1..{MAX_READ_BLOCKS}, got "
                         f"{blocks!r}")
    return FetchInstruction(f"{parts.scheme}://{parts.netloc}", int(blocks))


class _Failed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class _FallBack(Exception):
    """The CUDA IPC path cannot serve this fetch; ``stop``: nor, for a while, this holder."""

    def __init__(self, reason: str, detail: str, stop: bool) -> None:
        super().__init__(detail)
        self.reason = reason
        self.stop = stop


class PeerFetcher:
    """Runs fetches (module docstring) for one worker.

    Args:
        settings: the worker's settings (engine, block size, timeout, concurrency, the
            sim engine's transfer model).
        http: the client that reaches peers.
        clock: monotonic seconds, for the fetch's duration.
        ipc: the CUDA IPC path's holders (None: every fetch reads bytes over HTTP).
    """

    def __init__(self, settings: WorkerSettings, http: httpx.AsyncClient,
                 clock: Callable[[], float] = time.monotonic,
                 ipc: IpcPeers | None = None) -> None:
        self._settings = settings
        self._http = http
        self._clock = clock
        self.ipc = ipc if ipc is not None else IpcPeers(None)
        self._slots = asyncio.Semaphore(settings.kv_fetch_concurrency)
        self._logged: set[str] = set()
        #: Fetches waiting for a slot, and holding one, now.
        self.waiting = 0
        self.running = 0

    @property
    def http(self) -> httpx.AsyncClient:
        """The client that reaches peers."""
        return self._http

    @http.setter
    def http(self, client: httpx.AsyncClient) -> None:
        self._http = client

    def failed(self, reason: str, detail: str) -> FetchResult:
        """A fetch that failed for ``reason``: logged the first time a reason is seen."""
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("a peer KV fetch failed (%s: %s); the request computes its prompt "
                        "here (further failures for this reason are counted, not logged)",
                        reason, detail)
        return FetchResult(failure=reason)

    async def fetch(self, engine: Engine, prompt: Prompt, instruction: FetchInstruction,
                    headers: dict[str, str]) -> FetchResult:
        """Take ``prompt``'s leading blocks from ``instruction.source`` into ``engine``'s
        cache (module docstring); ``headers`` authenticate to the source. Never raises for
        a failed fetch: the result says why."""
        started = self._clock()
        bs = engine.cache.block_size
        want = min(instruction.blocks, (len(prompt.token_ids) - 1) // bs)
        blocks = RequestBlocks(prompt, bs)
        keys = [blocks.block(i).key for i in range(want)]
        held = engine.cache.cached_run(keys)
        if held >= want:
            return FetchResult()
        try:
            async with asyncio.timeout(self._settings.kv_fetch_timeout):
                self.waiting += 1
                try:
                    await self._slots.acquire()
                finally:
                    self.waiting -= 1
                self.running += 1
                fell_back: list[str] = []
                try:
                    received, moved, transfer = await self._take(
                        engine, prompt, keys, held, instruction.source, headers, fell_back)
                finally:
                    self.running -= 1
                    self._slots.release()
        except TimeoutError:
            return self.failed("timeout", f"{instruction.source} took longer than "
                               f"{self._settings.kv_fetch_timeout:g} s")
        except _Failed as exc:
            return self.failed(exc.reason, str(exc))
        except Exception as exc:  # a fetch never fails its request: it computes instead
            log.exception("a peer KV fetch from %s failed unexpectedly", instruction.source)
            return self.failed("error", repr(exc))
        return FetchResult(received // bs, moved, self._clock() - started, transfer=transfer,
                           ipc_fallback=fell_back[0] if fell_back else None)

    async def _take(self, engine: Engine, prompt: Prompt, keys: list[BlockKey], held: int,
                    source: str, headers: dict[str, str], fell_back: list[str]
                    ) -> tuple[int, int, str]:
        """The tokens received, the bytes moved and the transfer that moved them: CUDA IPC
        where it can be used, else (or when it fails for its own reasons, appended to
        ``fell_back``) HTTP.

        Raises:
            _Failed: the fetch failed; nothing was written.
        """
        kv = kv_pull.engine_kv(engine)
        if kv is not None and self.ipc.usable(source):
            try:
                received, moved = await self._take_ipc(engine, prompt, keys, held, source,
                                                       headers)
                return received, moved, TRANSFER
            except _FallBack as exc:
                self._fell_back(source, exc)
                fell_back.append(exc.reason)
        received, moved = await self._take_http(engine, prompt, keys, held, source, headers)
        return received, moved, "http"

    def _fell_back(self, source: str, exc: _FallBack) -> None:
        if exc.stop:
            self.ipc.use_http(source)
        key = f"ipc:{exc.reason}"
        if key not in self._logged:
            self._logged.add(key)
            log.warning("a peer KV fetch from %s over CUDA IPC fell back to HTTP (%s: %s)%s",
                        source, exc.reason, exc, " for a while" if exc.stop else "")

    async def _post_json(self, source: str, path: str, body: Any, headers: dict[str, str]
                         ) -> Any:
        """``source``'s JSON answer to a POST to ``path``.

        Raises:
            _Failed: an answer the byte path would meet too (unreachable, 401, 403, 503).
            _FallBack: any other error status, or an answer that is not JSON.
        """
        url = f"{source}{path}"
        try:
            data = await fetch_body(self._http, "POST", url, _IPC_ANSWER_BYTES,
                                    headers=headers, json=body)
        except PeerRefused as exc:
            if exc.status in (401, 403, 503):
                raise _Failed(f"status_{exc.status}", str(exc)) from None
            raise _FallBack(f"status_{exc.status}", str(exc), stop=True) from None
        except PeerUnreachable as exc:
            # A holder that is gone may come back as another process: drop its mapping now
            # rather than keep its old pool mapped (and perhaps its memory held).
            self.ipc.forget(source)
            raise _Failed("unreachable", str(exc)) from None
        except TransferError as exc:
            raise _FallBack("bad_message", str(exc), stop=True) from None
        try:
            return json.loads(data)
        except ValueError:
            raise _FallBack("bad_message", f"{url} answered no JSON", stop=True) from None

    async def _mapped(self, kv: Any, source: str, headers: dict[str, str]) -> MappedPool:
        pool = self.ipc.mapped(source)
        if pool is not None:
            return pool
        me = self.ipc.identity
        assert me is not None, "IpcPeers.usable let a worker without a backend through"
        body = await self._post_json(source, OPEN_PATH, {"device": me.as_json()}, headers)
        backend = self.ipc.backend
        assert backend is not None
        try:
            pool_id, handle, blocks = parse_open_answer(body, kv.layout())
            mapped = await asyncio.to_thread(backend.open, handle, blocks)
        except TransferError as exc:
            raise _FallBack("open_failed", str(exc), stop=True) from None
        pool = MappedPool(pool_id, mapped, blocks)
        self.ipc.keep(source, pool)
        return pool

    async def _take_ipc(self, engine: Engine, prompt: Prompt, keys: list[BlockKey], held: int,
                        source: str, headers: dict[str, str]) -> tuple[int, int]:
        """:meth:`_take` over CUDA IPC (:mod:`workers.http.kv_ipc`).

        Raises:
            _Failed: a failure HTTP would meet too; nothing was written.
            _FallBack: this path cannot be used; nothing was written.
        """
        kv = kv_pull.engine_kv(engine)
        bs = engine.cache.block_size
        pool = await self._mapped(kv, source, headers)
        asked = keys[held:]
        body = {"block_keys": [k.hex() for k in asked], "transfer": TRANSFER}
        answer = await self._post_json(source, "/kv_transfer/read", body, headers)
        got = self._clock()
        try:
            read = parse_read_answer(answer, len(asked))
        except TransferError as exc:
            raise _FallBack("bad_message", str(exc), stop=True) from None
        try:
            if read.pool_id != pool.pool_id:
                self.ipc.forget(source)
                raise _FallBack("new_pool", f"{source} restarted (another pool)", stop=False)
            n = len(read.block_ids)
            if n == 0:
                raise _Failed("missing", f"{source} holds none of the blocks")
            if max(read.block_ids) >= pool.blocks:
                raise _FallBack("bad_message", f"{source} named a block past its pool",
                                stop=True)
            write = ipc_writer(self.ipc.backend, pool, read, held,  # type: ignore[arg-type]
                               got + read.lease_s / 2, self._clock)
            try:
                received = await engine.receive_blocks(prompt, (held + n) * bs, write)
            except PinLeaseEnded as exc:
                raise _Failed("timeout", str(exc)) from None
            except TransferError as exc:
                raise _Failed("evicted", str(exc)) from None
        finally:
            if read.block_ids:
                await self._release(source, read.pin, headers)
        if received == 0 and engine.cache.cached_run(keys) < held + n:
            raise _Failed("no_free_blocks", "too few free blocks to take the KV")
        return received, n * kv.layout().block_bytes

    async def _release(self, source: str, pin: str, headers: dict[str, str]) -> None:
        """Tell the holder its pin can go (its lease ends it anyway if this fails)."""
        try:
            answer = await self._http.post(f"{source}{RELEASE_PATH}", json={"pin": pin},
                                           headers=headers)
            await answer.aclose()
        except httpx.HTTPError as exc:
            log.debug("releasing pin %s on %s failed: %r", pin, source, exc)

    async def _take_http(self, engine: Engine, prompt: Prompt, keys: list[BlockKey], held: int,
                         source: str, headers: dict[str, str]) -> tuple[int, int]:
        """:meth:`_take` over HTTP: the bytes in a :mod:`workers.torch.kv_wire` message (the
        torch engine) or a count (the sim engine).

        Raises:
            _Failed: the fetch failed; nothing was written.
        """
        s, bs = self._settings, engine.cache.block_size
        asked = keys[held:]
        url = f"{source}/kv_transfer/read"
        body = {"block_keys": [k.hex() for k in asked]}
        kv = kv_pull.engine_kv(engine)
        limit = _SIM_ANSWER_BYTES if kv is None else max_message_bytes(kv.layout(), len(asked))
        try:
            data = await fetch_body(self._http, "POST", url, limit, headers=headers, json=body)
        except PeerRefused as exc:
            raise _Failed(f"status_{exc.status}", str(exc)) from None
        except PeerUnreachable as exc:
            raise _Failed("unreachable", str(exc)) from None
        except TransferError as exc:
            raise _Failed("bad_message", str(exc)) from None
        write = None
        if kv is None:
            n = _sim_blocks(data, len(asked))
            moved = n * bs * s.kv_bytes_per_token
            await asyncio.sleep(moved / s.kv_transfer_bandwidth / s.speedup)
        else:
            try:
                message = decode(data, kv.layout(), len(asked))
            except TransferError as exc:
                raise _Failed("bad_message", str(exc)) from None
            n, moved = message.blocks, len(data)
            write = message_writer(kv, message, offset=held)
        if n == 0:
            raise _Failed("missing", f"{source} holds none of the blocks")
        try:
            received = await engine.receive_blocks(prompt, (held + n) * bs, write)
        except TransferError as exc:  # this cache lost blocks it held when it asked
            raise _Failed("evicted", str(exc)) from None
        if received == 0 and engine.cache.cached_run(keys) < held + n:
            raise _Failed("no_free_blocks", "too few free blocks to take the KV")
        return received, moved


def _sim_blocks(data: bytes, asked: int) -> int:
    try:
        n = json.loads(data).get("blocks")
    except (ValueError, AttributeError):
        n = None
    if type(n) is not int or not 0 <= n <= asked:
        raise _Failed("bad_message", f"a sim engine's read answers {{\"blocks\": n}} with "
                      f"0 <= n <= {asked}, not {data[:100]!r}")
    return n
