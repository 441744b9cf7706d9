"""Disaggregated serving on the worker: vLLM's ``kv_transfer_params`` protocol.

A router sends the prefill worker the request with ``max_tokens`` 1 and
``"kv_transfer_params": {"do_remote_decode": true, ...}``; the worker serves it as usual (its
blocks stay in its prefix cache, released as any finished request's are) and answers with
``kv_transfer_params`` naming itself and the blocks it holds. The router copies those into
the original request to the decode worker, whose ``"do_remote_prefill": true`` makes it take
the prompt's KV from the prefill worker before it runs the request.

The prefill worker holds the prompt's blocks for the decode worker (:class:`HeldPrefills`):
referenced, so not evictable, until the decode worker has taken them (it tells the prefill
worker with ``POST /kv_transfer/release``, naming the ``remote_request_id`` of the params) or
until a lease of ``kv_lease_seconds`` (30 s, vLLM's; divided by ``speedup``) ends: a prefill
whose decode never comes costs its blocks for that long, no longer. Only the prompt's leading
blocks that are cached on the device when the prefill ends are held (and named).

The torch engine moves the bytes: the decode worker pulls the held blocks from the prefill
worker (:mod:`workers.http.kv_pull`), writes them into blocks of its own cache and publishes
them, as below; a transfer that fails costs nothing but the time: the request prefills there.

The sim engine moves no bytes: the transfer takes ``tokens * kv_bytes_per_token /
kv_transfer_bandwidth`` seconds (divided by ``speedup``), then the blocks enter the decode
worker's cache as committed blocks and go out on its event stream
(:meth:`~workers.engine.loop.Engine.receive_blocks`), so a router's index learns of them
from the receiver, as vLLM's decode server publishes the blocks it received. The request
then finds them cached and computes only its last block.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from openai_request.bodies import ApiError
from workers.cache.block_keys import Prompt
from workers.engine.leases import PrefillLeases
from workers.engine.loop import Engine
from workers.http.kv_pull import pull
from workers.settings import WorkerSettings
from workers.torch.kv_wire import TransferError

__all__ = ["HeldPrefills", "Transfer", "answer_params", "parse_transfer", "receive"]

log = logging.getLogger(__name__)

#: The most blocks one transfer may name (a prompt of 2 M tokens at block size 16).
MAX_REMOTE_BLOCKS = 1 << 17


@dataclass(frozen=True, slots=True)
class Transfer:
    """What a request's ``kv_transfer_params`` ask of this worker."""

    #: Prefill only, for a decode worker that takes the KV (answer with the params).
    remote_decode: bool = False
    #: The prompt's first blocks were prefilled elsewhere: take them before running.
    remote_blocks: int = 0
    #: Where to say they were taken: the prefill worker's release URL and lease (None: a
    #: prefill worker that leases nothing, such as vLLM's, which the transfer itself tells).
    release_url: str | None = None
    remote_request_id: str | None = None
    #: Where the held blocks' bytes are (the torch engine's transfer, :mod:`workers.http.kv_pull`).
    blocks_url: str | None = None


class HeldPrefills:
    """The prefills this worker holds for their decode workers, each under a lease.

    Args:
        lease_s: how long a prefill's blocks are held at most.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._leases = PrefillLeases(lease_s)
        self._clock = clock
        self._engines: dict[str, Engine] = {}

    def __len__(self) -> int:
        return len(self._engines)

    def hold(self, engine: Engine, prompt: Prompt) -> str | None:
        """Hold ``prompt``'s blocks on ``engine``; returns the lease id (None: too few blocks
        were free to hold them, and the decode worker may find them evicted)."""
        self.expire()
        lease_id = f"lease-{uuid.uuid4().hex}"
        if not engine.hold_blocks(lease_id, prompt):
            return None
        self._leases.grant(lease_id, self._clock())
        self._engines[lease_id] = engine
        return lease_id

    def held(self, lease_id: str) -> tuple[Engine, tuple[int, ...]] | None:
        """The engine and device blocks of a prefill held under ``lease_id``, or None (unknown
        or ended lease)."""
        self.expire()
        engine = self._engines.get(lease_id)
        return None if engine is None else (engine, engine.held_blocks(lease_id))

    def release(self, lease_id: str) -> bool:
        """The decode worker took the KV: let it go; False for an unknown or ended lease."""
        if not self._leases.claim(lease_id):
            return False
        self._engines.pop(lease_id).release_blocks(lease_id)
        return True

    def expire(self) -> int:
        """Let go of every prefill whose lease ended; returns how many."""
        ended = self._leases.expired(self._clock())
        for lease_id in ended:
            self._engines.pop(lease_id).release_blocks(lease_id)
        return len(ended)


def parse_transfer(body: dict[str, Any]) -> Transfer | None:
    """The request's ``kv_transfer_params``, or None when it has none.

    Raises:
        ApiError: malformed params (400), naming the field.
    """
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    for name, value in (("do_remote_decode", decode), ("do_remote_prefill", prefill)):
        if value is not None and type(value) is not bool:
            raise ApiError(400, f"kv_transfer_params.{name} must be true or false",
                           param="kv_transfer_params")
    if decode and prefill:
        raise ApiError(400, "kv_transfer_params asks for both a remote decode and a remote "
                       "prefill", param="kv_transfer_params")
    blocks = 0
    if prefill:
        ids = params.get("remote_block_ids")
        if not isinstance(ids, list) or len(ids) > MAX_REMOTE_BLOCKS:
            raise ApiError(400, "kv_transfer_params.remote_block_ids must be a list of at "
                           f"most {MAX_REMOTE_BLOCKS} block ids", param="kv_transfer_params")
        blocks = len(ids)
        lease, host, port = (params.get(k) for k in ("remote_request_id", "remote_host",
                                                      "remote_port"))
        if isinstance(lease, str) and isinstance(host, str) and type(port) is int:
            base = f"http://{host}:{port}/kv_transfer"
            return Transfer(remote_blocks=blocks, remote_request_id=lease,
                            release_url=f"{base}/release",
                            blocks_url=f"{base}/blocks/{quote(lease, safe='')}")
    return Transfer(remote_decode=bool(decode), remote_blocks=blocks)


def answer_params(settings: WorkerSettings, instance_id: str, prompt_tokens: int,
                  lease_id: str | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill answer carries for its decode worker: this
    worker, the prompt's full blocks it holds, and the lease they are held under."""
    blocks = max(0, prompt_tokens - 1) // settings.block_size
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_engine_id": instance_id, "remote_block_ids": list(range(blocks)),
              "remote_host": settings.host, "remote_port": settings.port, "tp_size": 1}
    if lease_id is not None:
        params["remote_request_id"] = lease_id
    return params


async def receive(settings: WorkerSettings, engine: Engine, prompt: Prompt,
                  transfer: Transfer, http: httpx.AsyncClient | None = None,
                  headers: dict[str, str] | None = None) -> tuple[int, str | None]:
    """Take ``transfer``'s blocks of ``prompt``'s KV from the prefill worker (the sim engine
    simulates it, the module docstring; the torch engine pulls the bytes,
    :func:`workers.http.kv_pull.pull`), then tell the prefill worker they were taken (with
    ``http``, when the params name a lease; a failure to tell is logged, and the lease ends
    the hold). ``headers`` go with the pull and the release (the KV transfer secret, when
    the request that named the prefill worker was authenticated).

    Returns:
        The tokens received, and why none were when a pull failed (None otherwise): the
        request then prefills those tokens itself.
    """
    failure = None
    if settings.engine == "sim":
        tokens = min(transfer.remote_blocks * settings.block_size, len(prompt.token_ids))
        seconds = tokens * settings.kv_bytes_per_token / settings.kv_transfer_bandwidth
        await asyncio.sleep(seconds / settings.speedup)
        received = await engine.receive_blocks(prompt, tokens)
    else:
        try:
            received = await pull(engine, prompt, transfer, http, headers)
        except TransferError as exc:
            received, failure = 0, str(exc)
            log.warning("the KV transfer from %s failed (%s); prefilling the prompt here",
                        transfer.blocks_url, exc)
    if http is not None and transfer.release_url is not None:
        try:
            answer = await http.post(transfer.release_url, headers=headers,
                                     json={"remote_request_id": transfer.remote_request_id})
            if answer.status_code != 200:
                log.warning("the prefill worker at %s refused the release (%d: %s); its lease "
                            "will end the hold", transfer.release_url, answer.status_code,
                            answer.text[:200])
        except httpx.HTTPError as exc:
            log.warning("could not release the prefill at %s (%s); its lease will",
                        transfer.release_url, exc)
    return received, failure
