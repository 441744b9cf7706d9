"""Peer KV fetch, the holder's side: ``POST /kv_transfer/read`` serves blocks by engine key.

A peer that was told to fetch a prompt's leading blocks from this worker
(:mod:`workers.http.kv_fetch`) posts their engine block keys, in prompt order
(``{"block_keys": ["<64 hex digits>", ...]}``). The keys chain the cache salt and the LoRA
scope (:mod:`workers.cache.block_keys`), so a reader can name only blocks of a prompt it
holds itself, in its own scope. This worker answers the LEADING run of the named blocks it
holds on the device (it stops at the first one it does not):

- torch engine: one :mod:`workers.torch.kv_wire` message, streamed :data:`CHUNK_BLOCKS`
  blocks at a time, each read in a thread (as :func:`workers.http.kv_pull.serve_blocks`);
- sim engine: ``{"blocks": n}``, no bytes (the reader models the transfer's time);
- a read naming ``"transfer": "cuda_ipc"`` (a torch worker on the same GPU): the pinned
  blocks' ids, no bytes; the pin lasts until the reader releases it
  (``POST /kv_transfer/read/release``) after copying them device to device
  (:mod:`workers.http.kv_ipc`).

The blocks are pinned while they are read (:meth:`workers.engine.loop.Engine.pin_blocks`):
nothing is taken, evicted or copied for a read, and a pin never takes an evictable block the
holder's waiting requests would need (:func:`reserve_blocks`: the run stops short instead,
and a read that could pin none of the blocks held is answered 503, ``no_room``). At most
``kv_read_concurrency`` reads run at once; one past them is answered 503 at once, costing the
holder nothing, and the reader computes the prompt itself. A pin whose answer is never read
to its end (a reader that left) is let go when its answer ends or, at the latest,
:data:`READ_LEASE_S` seconds after it was taken.

Who may read is :mod:`workers.http.transfer_auth`'s rule.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from openai_request.bodies import ApiError
from workers.cache.block_keys import BlockKey
from workers.engine.leases import PrefillLeases
from workers.engine.loop import Engine
from workers.http import kv_pull
from workers.http.kv_ipc import TRANSFER as CUDA_IPC
from workers.http.kv_ipc import HolderIpc
from workers.torch.kv_wire import header_bytes

__all__ = ["MAX_READ_BLOCKS", "READ_BODY_BYTES", "READ_LEASE_S", "TRANSFERS", "BlockReads",
           "parse_keys", "parse_transfer", "reserve_blocks"]

#: The most keys one read may name (a prompt of 2 M tokens at block size 16).
MAX_READ_BLOCKS = 1 << 17
#: A read's body: up to :data:`MAX_READ_BLOCKS` quoted keys of 64 hex digits, and a little.
READ_BODY_BYTES = MAX_READ_BLOCKS * 68 + 1024
#: The longest a read's pin lasts when its answer is never read to the end.
READ_LEASE_S = 60.0

_KEY_HEX = 64
#: The ``transfer`` a read may name: its blocks' bytes in the answer, or their ids.
TRANSFERS = ("http", CUDA_IPC)


def parse_keys(body: dict[str, Any]) -> list[BlockKey]:
    """The engine block keys a read names, in order.

    Raises:
        ApiError: 400 naming what is wrong (not a list, too many, a key that is not 64 hex
            digits).
    """
    keys = body.get("block_keys")
    if not isinstance(keys, list) or len(keys) > MAX_READ_BLOCKS:
        raise ApiError(400, f"block_keys must be a list of at most {MAX_READ_BLOCKS} keys",
                       param="block_keys")
    out: list[BlockKey] = []
    for i, key in enumerate(keys):
        if not isinstance(key, str) or len(key) != _KEY_HEX:
            raise ApiError(400, f"block_keys[{i}] must be {_KEY_HEX} hex digits (a 32-byte "
                           "engine block key)", param="block_keys")
        try:
            out.append(bytes.fromhex(key))
        except ValueError:
            raise ApiError(400, f"block_keys[{i}] is not hex", param="block_keys") from None
    return out


def parse_transfer(body: dict[str, Any]) -> str:
    """How a read wants its blocks: ``http`` (the default: their bytes) or ``cuda_ipc``.

    Raises:
        ApiError: 400, another value.
    """
    transfer = body.get("transfer", "http")
    if transfer not in TRANSFERS:
        raise ApiError(400, f"transfer must be one of {', '.join(TRANSFERS)}",
                       param="transfer")
    return str(transfer)


def _device_run(engine: Engine, keys: Sequence[BlockKey]) -> int:
    pool = engine.cache.pool
    for i, key in enumerate(keys):
        if pool.cached_block(key) is None:
            return i
    return len(keys)


def reserve_blocks(engine: Engine) -> int:
    """Blocks a read must leave free for the holder's own waiting requests: their prompts'
    (a running prefill took its blocks at admission). Counted with the running prefills'
    rest too, a holder part way through a long prompt pinned nothing however much was free,
    and its readers were told it held none of the blocks."""
    bs = engine.cache.block_size
    return -(-engine.batcher.waiting_prompt_tokens // bs)


class BlockReads:
    """The reads this worker is serving: each one's engine and pin, under a lease.

    Args:
        engines: the worker's engines (one per data-parallel rank); a read is served by the
            one that holds the longest run of its keys.
        concurrency: reads served at once.
        clock: monotonic seconds (injected in tests).
        ipc: the first engine's CUDA IPC side (None: reads naming ``cuda_ipc`` get 409).
    """

    def __init__(self, engines: Sequence[Engine], concurrency: int,
                 clock: Callable[[], float] = time.monotonic,
                 ipc: HolderIpc | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self._engines = tuple(engines)
        self._concurrency = concurrency
        self._clock = clock
        self._leases = PrefillLeases(READ_LEASE_S)
        self._pinned: dict[str, Engine] = {}
        self.ipc = ipc

    def __len__(self) -> int:
        """Reads being served now."""
        return len(self._pinned)

    def expire(self) -> int:
        """Let go of every pin whose lease ended; returns how many."""
        ended = self._leases.expired(self._clock())
        for pin_id in ended:
            self._pinned.pop(pin_id).unpin_blocks(pin_id)
        return len(ended)

    def finish(self, pin_id: str) -> bool:
        """A read's answer ended, or its reader released it: let go of its pin. False when
        it was not held (unknown, finished, or its lease ended): safe to call twice."""
        if self._leases.claim(pin_id):
            self._pinned.pop(pin_id).unpin_blocks(pin_id)
            return True
        return False

    def pin(self, keys: Sequence[BlockKey]) -> tuple[str, Engine, tuple[int, ...]]:
        """Pin the leading run of ``keys`` on the engine that holds the most of it.

        Returns:
            The pin's id, its engine and its device blocks (empty: none held; nothing is
            pinned, and :meth:`finish` is a no-op).

        Raises:
            ApiError: 503 when :attr:`concurrency` reads are being served already (``busy``),
                or when the first block is held but pinning it would take a block the
                waiting requests need (``no_room``, :func:`reserve_blocks`).
        """
        self.expire()
        if len(self._pinned) >= self._concurrency:
            raise ApiError(503, f"this worker serves {self._concurrency} KV reads at once; "
                           "compute the prompt instead", "server_error", code="busy")
        engine = max(self._engines, key=lambda e: _device_run(e, keys))
        pin_id = f"read-{uuid.uuid4().hex}"
        block_ids = engine.pin_blocks(pin_id, keys, keep_free=reserve_blocks(engine))
        if not block_ids and _device_run(engine, keys[:1]):
            raise ApiError(503, "this worker holds the blocks but keeps its free blocks for "
                           "its waiting requests; compute the prompt instead", "server_error",
                           code="no_room")
        if block_ids:
            self._leases.grant(pin_id, self._clock())
            self._pinned[pin_id] = engine
        return pin_id, engine, block_ids

    async def answer(self, keys: Sequence[BlockKey], transfer: str = "http"
                     ) -> tuple[Response, int]:
        """The answer to a read of ``keys`` (module docstring), and the blocks it holds.

        Raises:
            ApiError: 503 (busy, :meth:`pin`); 409 (``cuda_ipc`` asked of a worker whose KV
                is not on CUDA).
        """
        if transfer == CUDA_IPC:
            return await self._answer_ipc(keys)
        pin_id, engine, block_ids = self.pin(keys)
        kv = kv_pull.engine_kv(engine)
        if kv is None:  # the sim engine: the count, and the reader models the bytes
            self.finish(pin_id)
            return JSONResponse({"blocks": len(block_ids)}), len(block_ids)
        layout = kv.layout()
        head = header_bytes(layout, len(block_ids))
        chunk = kv_pull.CHUNK_BLOCKS

        async def body() -> AsyncIterator[bytes]:
            try:
                yield head
                for i in range(0, len(block_ids), chunk):
                    if pin_id not in self._pinned:  # its lease ended: blocks may be reused
                        raise RuntimeError(f"the read {pin_id} outlived its pin")
                    yield await asyncio.to_thread(kv.read_blocks, block_ids[i:i + chunk])
            finally:
                self.finish(pin_id)

        size = len(head) + len(block_ids) * layout.block_bytes
        return StreamingResponse(body(), media_type="application/octet-stream",
                                 headers={"content-length": str(size)}), len(block_ids)

    async def _answer_ipc(self, keys: Sequence[BlockKey]) -> tuple[Response, int]:
        ipc = self.ipc
        if ipc is None or ipc.backend is None:
            raise ApiError(409, "this worker's KV is not on a CUDA device; read it over HTTP",
                           code="no_cuda_ipc")
        pin_id, _, block_ids = self.pin(keys)
        if block_ids:
            # A kernel of the iteration that computed them may still be queued: the reader
            # copies on its own stream, which cannot wait for this process's.
            await asyncio.to_thread(ipc.backend.sync)
            if pin_id not in self._pinned:
                raise RuntimeError(f"the read {pin_id} outlived its pin")
        return JSONResponse({"pool": ipc.pool_id, "pin": pin_id, "block_ids": list(block_ids),
                             "lease_s": READ_LEASE_S}), len(block_ids)
