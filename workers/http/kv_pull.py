"""The torch engine's KV transfer over HTTP: a decode worker pulls a held prefill's blocks.

The prefill worker serves ``GET /kv_transfer/blocks/{remote_request_id}`` (to the peers
:mod:`workers.http.transfer_auth` admits, as ``/kv_transfer/release`` and the block reads of
:mod:`workers.http.kv_read`) with the blocks it holds under that lease, as one
:mod:`workers.torch.kv_wire` message. The decode worker
(:func:`pull`) reads at most the message its prompt can need, checks it against its own
block layout, writes the blocks into fresh blocks of its cache and commits them, which
publishes them as stored blocks (:meth:`~workers.engine.loop.Engine.receive_blocks`); the
request then finds them cached. Any failure (the prefill worker unreachable or answering an
error, a lease that ended, a message cut short, too long, of another dtype or shape) raises
:class:`~workers.torch.kv_wire.TransferError` having written nothing, and the request
prefills the prompt itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Response
from fastapi.responses import StreamingResponse

from openai_request.bodies import ApiError
from workers.cache.block_keys import Prompt
from workers.engine.loop import Engine, WriteBlocks
from workers.torch.kv_wire import (
    KVMessage,
    TransferError,
    decode,
    header_bytes,
    max_message_bytes,
)

if TYPE_CHECKING:
    from workers.http.kv_transfer import HeldPrefills, Transfer

__all__ = ["CHUNK_BLOCKS", "PULL_TIMEOUT_S", "PeerRefused", "PeerUnreachable", "engine_kv",
           "fetch_body", "message_writer", "pull", "serve_blocks"]

#: The most seconds one pull may take, connection to last byte.
PULL_TIMEOUT_S = 30.0
#: Blocks read and sent at a time by the prefill worker.
CHUNK_BLOCKS = 64


class PeerUnreachable(TransferError):
    """The peer could not be reached, or its answer was cut off."""


class PeerRefused(TransferError):
    """The peer answered an HTTP error status (:attr:`status`)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def engine_kv(engine: Engine) -> Any:
    """The engine's KV storage (:class:`~workers.torch.kv.PagedKV`), or None (sim engine)."""
    return getattr(engine.executor, "kv", None)


async def serve_blocks(held: HeldPrefills, lease_id: str) -> Response:
    """The answer to ``GET /kv_transfer/blocks/{lease_id}``: the held blocks as a message,
    streamed :data:`CHUNK_BLOCKS` blocks at a time (each read in a thread). A lease that ends
    while its blocks are being sent cuts the answer short, which the reader refuses.

    Raises:
        ApiError: no prefill is held under ``lease_id`` (404), or this worker's engine holds
            no KV bytes (409: the sim engine).
    """
    found = held.held(lease_id)
    if found is None:
        raise ApiError(404, f"no prefill is held under {lease_id!r} (unknown, taken, or its "
                       "lease ended)", param="remote_request_id", code="not_found")
    engine, block_ids = found
    kv = engine_kv(engine)
    if kv is None:
        raise ApiError(409, "this worker's engine holds no KV bytes to send (the sim engine "
                       "simulates its transfers)", code="no_kv")
    layout = kv.layout()
    head = header_bytes(layout, len(block_ids))

    async def body() -> AsyncIterator[bytes]:
        yield head
        for i in range(0, len(block_ids), CHUNK_BLOCKS):
            if held.held(lease_id) is None:  # released or ended: the blocks may be reused
                raise RuntimeError(f"the lease {lease_id} ended while its blocks were sent")
            yield await asyncio.to_thread(kv.read_blocks, block_ids[i:i + CHUNK_BLOCKS])

    size = len(head) + len(block_ids) * layout.block_bytes
    return StreamingResponse(body(), media_type="application/octet-stream",
                             headers={"content-length": str(size)})


async def pull(engine: Engine, prompt: Prompt, transfer: Transfer,
               http: httpx.AsyncClient | None, headers: dict[str, str] | None = None) -> int:
    """Pull ``transfer``'s held blocks of ``prompt`` from the prefill worker into ``engine``'s
    cache (module docstring); returns the tokens received. ``headers`` go with the request
    (the KV transfer secret, :meth:`workers.http.transfer_auth.TransferAuth.outgoing`).

    Raises:
        TransferError: the pull failed; nothing was written.
    """
    kv = engine_kv(engine)
    if kv is None:
        raise TransferError("this worker's engine holds no KV to receive into")
    if transfer.blocks_url is None or http is None:
        raise TransferError("the kv_transfer_params name no held prefill (remote_request_id, "
                            "remote_host, remote_port) to pull from")
    bs = engine.cache.block_size
    wanted = min(transfer.remote_blocks, (len(prompt.token_ids) - 1) // bs)
    if wanted <= 0:
        return 0
    layout = kv.layout()
    try:
        async with asyncio.timeout(PULL_TIMEOUT_S):
            data = await fetch_body(http, "GET", transfer.blocks_url,
                                    max_message_bytes(layout, wanted), headers=headers)
    except TimeoutError:
        raise TransferError(f"{transfer.blocks_url} took longer than {PULL_TIMEOUT_S:.0f} s"
                            ) from None
    message = decode(data, layout, wanted)
    return await engine.receive_blocks(prompt, message.tokens, message_writer(kv, message))


def message_writer(kv: Any, message: KVMessage, offset: int = 0) -> WriteBlocks:
    """The :data:`~workers.engine.loop.WriteBlocks` that puts ``message``'s blocks, which
    are the prompt's blocks ``offset, offset + 1, ...``, into ``kv``.

    Raises (when called):
        TransferError: asked for a block before ``offset`` (the receiver's own cache lost
            blocks it held when the message was asked for; nothing is written).
    """
    size = message.layout.block_bytes

    def write(first: int, block_ids: tuple[int, ...]) -> None:
        # Blocks past what the sender held stay unwritten: receive_blocks commits only the
        # positions it was told of, so write is never asked for them.
        start = first - offset
        if start < 0:
            raise TransferError(f"block {first} is not in the message, which starts at "
                                f"block {offset}")
        kv.write_blocks(block_ids, message.payload[start * size:(start + len(block_ids)) * size])

    return write


async def fetch_body(http: httpx.AsyncClient, method: str, url: str, limit: int,
                     headers: dict[str, str] | None = None, json: Any = None) -> bytes:
    """The body ``url`` answers, refused past ``limit`` bytes (the caller bounds the time).

    Raises:
        TransferError: :class:`PeerUnreachable`, :class:`PeerRefused` (an error status),
            or a body longer than ``limit``.
    """
    try:
        async with http.stream(method, url, headers=headers, json=json) as answer:
            if answer.status_code != 200:
                text = (await answer.aread())[:200].decode(errors="replace")
                raise PeerRefused(f"{url} answered {answer.status_code}: {text}",
                                  answer.status_code)
            declared = answer.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise TransferError(f"{url} sends {declared} bytes, more than the {limit} "
                                    "its prompt can need")
            body = bytearray()
            async for chunk in answer.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise TransferError(f"{url} sent more than the {limit} bytes its prompt "
                                        "can need")
    except httpx.HTTPError as exc:
        raise PeerUnreachable(f"{url} could not be read: {exc!r}") from None
    return bytes(body)
