"""Disaggregated serving on the worker: vLLM's ``kv_transfer_params`` protocol, simulated.

A router sends the prefill worker the request with ``max_tokens`` 1 and
``"kv_transfer_params": {"do_remote_decode": true, ...}``; the worker serves it as usual (its
blocks stay in its prefix cache, released as any finished request's are) and answers with
``kv_transfer_params`` naming itself and the blocks it holds. The router copies those into
the original request to the decode worker, whose ``"do_remote_prefill": true`` makes it take
the prompt's KV from the prefill worker before it runs the request.

The sim engine moves no bytes: the transfer takes ``tokens * kv_bytes_per_token /
kv_transfer_bandwidth`` seconds (divided by ``speedup``), then the blocks enter the decode
worker's cache as committed blocks and go out on its event stream
(:meth:`~workers.engine.loop.Engine.receive_blocks`), so a router's index learns of them
from the receiver, as vLLM's decode server publishes the blocks it received. The request
then finds them cached and computes only its last block.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from openai_request.bodies import ApiError
from workers.cache.block_keys import Prompt
from workers.engine.loop import Engine
from workers.settings import WorkerSettings

__all__ = ["Transfer", "answer_params", "parse_transfer", "receive"]

#: The most blocks one transfer may name (a prompt of 2 M tokens at block size 16).
MAX_REMOTE_BLOCKS = 1 << 17


@dataclass(frozen=True, slots=True)
class Transfer:
    """What a request's ``kv_transfer_params`` ask of this worker."""

    #: Prefill only, for a decode worker that takes the KV (answer with the params).
    remote_decode: bool = False
    #: The prompt's first blocks were prefilled elsewhere: take them before running.
    remote_blocks: int = 0


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
    return Transfer(remote_decode=bool(decode), remote_blocks=blocks)


def answer_params(settings: WorkerSettings, instance_id: str, prompt_tokens: int
                  ) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill answer carries for its decode worker: this
    worker, and the prompt's full blocks it holds."""
    blocks = max(0, prompt_tokens - 1) // settings.block_size
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": instance_id, "remote_block_ids": list(range(blocks)),
            "remote_host": settings.host, "remote_port": settings.port, "tp_size": 1}


async def receive(settings: WorkerSettings, engine: Engine, prompt: Prompt, blocks: int
                  ) -> int:
    """Take ``blocks`` of ``prompt``'s KV from the prefill worker (simulated: the module
    docstring); returns the tokens received."""
    tokens = min(blocks * settings.block_size, len(prompt.token_ids))
    seconds = tokens * settings.kv_bytes_per_token / settings.kv_transfer_bandwidth
    await asyncio.sleep(seconds / settings.speedup)
    return await engine.receive_blocks(prompt, tokens)
