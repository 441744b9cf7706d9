"""What the router knows of one worker: its ``/model_info``, and whether it may join.

Pure values and checks; the polling shell is :mod:`router.fleet.registry`, and the worker's JSON
answers are parsed in :mod:`router.fleet.worker_answers`.

A worker whose block size or tokenizer differs from the router's would be indexed under hashes
no request can ever match ("overlap always 0", the commonest silent failure in peers' issue
trackers), so it is refused with an error that names both values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["IncompatibleWorker", "WorkerInfo", "WorkerState", "resolve_endpoint"]

_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


class IncompatibleWorker(ValueError):
    """The worker cannot be routed to by this router (block size, tokenizer, model info)."""


class WorkerState(enum.Enum):
    """Where a worker stands. Only HEALTHY workers are candidates."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    INCOMPATIBLE = "incompatible"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's ``GET /model_info``, checked."""

    url: str
    model: str
    block_size: int
    tokenizer: str
    instance_id: str
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    data_parallel_rank: int = 0
    mm_tokens_per_image: int = 0
    image_routing_version: int | None = None
    salt_hashing: str | None = None
    snapshot: bool = False
    max_model_len: int = 0
    num_blocks: int = 0
    max_num_seqs: int = 0
    lora_adapters: tuple[str, ...] = ()
    host_blocks: int = 0
    #: Data-parallel ranks the engine says it serves behind its URL (1: none).
    data_parallel_size: int = 1
    #: Peer KV fetch (``model_info`` ``kv_fetch``, docs/peer_fetch.md): it answers block
    #: reads, it honours fetch instructions, and the bytes of KV a token of its cache takes.
    kv_fetch_serve: bool = False
    kv_fetch_receive: bool = False
    kv_bytes_per_token: int = 0
    #: The machine and GPU its KV is on, when it also fetches over CUDA IPC (``kv_fetch``'s
    #: ``cuda_ipc``; None: it does not).
    kv_fetch_device: tuple[str, str] | None = None
    #: Bytes a second it says its fetches over HTTP move (``kv_fetch``'s ``http_bandwidth``;
    #: 0: it does not say).
    kv_fetch_http_bandwidth: float = 0.0

    def serves(self, model: str) -> bool:
        """Whether ``model`` names this worker's base model or one of its LoRA adapters."""
        return model == self.model or model in self.lora_adapters

    def check_compatible(self, block_size: int, tokenizer: str | None) -> None:
        """Raise :class:`IncompatibleWorker` unless this worker hashes like the router.

        Args:
            block_size: the router's block size.
            tokenizer: the router's tokenizer identity (``None``: accept any).
        """
        if self.block_size != block_size:
            raise IncompatibleWorker(
                f"worker {self.url} uses block size {self.block_size} but the router uses "
                f"{block_size}: its events could never match a request; start the router with "
                f"--block-size {self.block_size} or the worker with {block_size}")
        if tokenizer is not None and self.tokenizer != tokenizer:
            raise IncompatibleWorker(
                f"worker {self.url} tokenizes with {self.tokenizer!r} but the router with "
                f"{tokenizer!r}: the same request would become different tokens; give both "
                f"the same tokenizer")


def resolve_endpoint(value: Any, worker_url: str, name: str) -> str | None:
    """Return the event endpoint ``value`` a worker advertised, as the router can reach it.

    Args:
        value: the advertised endpoint (``None``: none).
        worker_url: the worker's base URL; a wildcard host is replaced by its host.
        name: the field's name, for the error.

    Raises:
        IncompatibleWorker: ``value`` is not an endpoint.
    """
    if value is None:
        return None
    if type(value) is not str or "://" not in value:
        raise IncompatibleWorker(f"worker {worker_url}: model_info {name} is not an endpoint")
    scheme, rest = value.split("://", 1)
    host, sep, port = rest.rpartition(":")
    if scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise IncompatibleWorker(f"worker {worker_url}: model_info {name} {value!r} is not a "
                                 "ZeroMQ endpoint (tcp://, ipc:// or inproc://)")
    if scheme == "tcp" and not _tcp_address(host, port, sep):
        raise IncompatibleWorker(f"worker {worker_url}: model_info {name} {value!r} is not "
                                 "tcp://HOST:PORT with a port in 1..65535")
    if scheme == "tcp" and host in _WILDCARD_HOSTS:
        # A worker bound to every interface advertises a wildcard; reach it where its HTTP is.
        host = urlsplit(worker_url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"tcp://{host}:{port}"
    return value


def _tcp_address(host: str, port: str, sep: str) -> bool:
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    if host in _WILDCARD_HOSTS:
        return True
    if host.startswith("[") or host.endswith("]"):
        return host.startswith("[") and host.endswith("]") and len(host) > 2
    return bool(host) and ":" not in host
