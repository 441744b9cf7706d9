"""The kvroute worker's control-plane answers (``GET /model_info``, ``GET /load``) as typed
structs.

Another process's JSON is untrusted input, parsed like an HTTP body: one ``msgspec`` decoder
per answer, built once; every number has a type and a finite range, so ``{"running": 1e999}``
or ``{"data_parallel_rank": "x"}`` is refused here with a message naming the field, never
turned into an exception deep in the registry. Unknown fields are ignored (a newer worker may
add some). A stock engine speaks other endpoints; its adapter parses them in a module of its
own beside this one and returns the same :class:`~router.fleet.worker_table.WorkerInfo` and
:class:`~router.routing.load.ReportedLoad`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from router.fleet.worker_table import WorkerInfo, resolve_endpoint
from router.routing.load import ReportedLoad

__all__ = ["MalformedAnswer", "parse_load", "parse_model_info"]

#: Counts (requests, blocks, tokens, lengths) are ints in [0, 2**40]: far above any real
#: engine's figure, and far below anything that would overflow arithmetic on them.
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
#: Amounts a worker may report as floats (blocks, tokens), finite and in the same range.
_Amount = Annotated[float, msgspec.Meta(ge=0, le=float(1 << 40))]
#: A share, such as the KV cache in use.
_Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class MalformedAnswer(ValueError):
    """A worker's control answer is not JSON of the expected shape; the message says where."""


class _Capacity(msgspec.Struct):
    num_blocks: _Count = 0
    host_blocks: _Count = 0
    max_num_seqs: _Count = 0


_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class _Device(msgspec.Struct):
    host: _Name
    gpu: _Name


class _KvFetch(msgspec.Struct):
    serve: bool = False
    receive: bool = False
    kv_bytes_per_token: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 0
    transfer: str = "http"
    transfers: Annotated[list[str], msgspec.Meta(max_length=16)] = msgspec.field(
        default_factory=list)
    cuda_ipc: _Device | None = None
    #: Bytes a second; a sim worker's figure scales with its ``speedup``, so the bound only
    #: refuses nonsense (a worker clamps what it advertises to the same 1e18).
    http_bandwidth: Annotated[float, msgspec.Meta(ge=0, le=1e18)] = 0.0


class _ModelInfo(msgspec.Struct):
    model: str
    block_size: Annotated[int, msgspec.Meta(gt=0, le=1 << 20)]
    tokenizer: str
    instance_id: str
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    data_parallel_rank: _Count = 0
    mm_tokens_per_image: _Count = 0
    salt_hashing: str | None = None
    kv_snapshot: bool = False
    max_model_len: _Count = 0
    capacity: _Capacity = msgspec.field(default_factory=_Capacity)
    lora_adapters: list[str] = msgspec.field(default_factory=list)
    extra: dict[str, object] = msgspec.field(default_factory=dict)
    data_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    kv_fetch: _KvFetch | None = None


class _Load(msgspec.Struct):
    running: _Count = 0
    waiting: _Count = 0
    pending_prefill_tokens: _Amount = 0.0
    decode_blocks: _Amount = 0.0
    kv_usage: _Fraction = 0.0


_MODEL_INFO = msgspec.json.Decoder(_ModelInfo)
_LOAD = msgspec.json.Decoder(_Load)


def parse_model_info(url: str, raw: bytes) -> WorkerInfo:
    """Parse a ``/model_info`` answer.

    Args:
        url: the worker's base URL (named in errors; a wildcard event endpoint is resolved
            against its host).
        raw: the answer's body.

    Returns:
        The worker's info (compatibility is checked by the caller).

    Raises:
        MalformedAnswer: not JSON, a required field missing, or a field of the wrong type or
            out of range.
        IncompatibleWorker: an event endpoint that is not an endpoint.
    """
    try:
        body = _MODEL_INFO.decode(raw)
    except msgspec.DecodeError as exc:
        raise MalformedAnswer(f"worker {url}: /model_info: {exc}") from None
    routing = body.extra.get("trtllm_image_routing_version")
    # Peer fetch over the one transfer this router speaks, with a size to price it by.
    fetch = body.kv_fetch
    if fetch is not None and (fetch.transfer != "http" or fetch.kv_bytes_per_token <= 0):
        fetch = None
    # Where its KV is, when it also copies fetched blocks over CUDA IPC: a peer of the same
    # GPU is priced at that path's bandwidth.
    ipc = fetch.cuda_ipc if fetch is not None and "cuda_ipc" in fetch.transfers else None
    return WorkerInfo(
        url=url,
        model=body.model,
        block_size=body.block_size,
        tokenizer=body.tokenizer,
        instance_id=body.instance_id,
        events_endpoint=resolve_endpoint(body.events_endpoint, url, "events_endpoint"),
        replay_endpoint=resolve_endpoint(body.replay_endpoint, url, "replay_endpoint"),
        data_parallel_rank=body.data_parallel_rank,
        mm_tokens_per_image=body.mm_tokens_per_image,
        image_routing_version=routing if type(routing) is int else None,
        salt_hashing=body.salt_hashing,
        snapshot=body.kv_snapshot,
        max_model_len=body.max_model_len,
        num_blocks=body.capacity.num_blocks,
        max_num_seqs=body.capacity.max_num_seqs,
        lora_adapters=tuple(body.lora_adapters),
        host_blocks=body.capacity.host_blocks,
        data_parallel_size=body.data_parallel_size,
        kv_fetch_serve=fetch is not None and fetch.serve,
        kv_fetch_receive=fetch is not None and fetch.receive,
        kv_bytes_per_token=fetch.kv_bytes_per_token if fetch is not None else 0,
        kv_fetch_device=(ipc.host, ipc.gpu) if ipc is not None else None,
        kv_fetch_http_bandwidth=fetch.http_bandwidth if fetch is not None else 0.0,
    )


def parse_load(raw: bytes, block_size: int) -> ReportedLoad:
    """Parse a ``/load`` answer into blocks.

    Args:
        raw: the answer's body.
        block_size: the worker's tokens per block (pending prefill is reported in tokens).

    Raises:
        MalformedAnswer: not a JSON object, or a figure of the wrong type or out of range.
    """
    try:
        load = _LOAD.decode(raw)
    except msgspec.DecodeError as exc:
        raise MalformedAnswer(f"/load: {exc}") from None
    return ReportedLoad(running=load.running, waiting=load.waiting,
                        pending_prefill_blocks=load.pending_prefill_tokens / block_size,
                        decode_blocks=load.decode_blocks, kv_usage=load.kv_usage)
