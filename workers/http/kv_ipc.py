"""Peer KV fetch over CUDA IPC: the HTTP side of copying blocks device to device.

Two torch workers on one GPU fetch KV without moving its bytes through HTTP
(:mod:`workers.torch.kv_ipc` does the CUDA part). The pool's handle reads and writes every
block of every tenant, where a byte read answers only keys its reader could name, so this
path runs only between workers given the shared secret (:class:`workers.http.state.WorkerState`
builds no backend without one). The steps, each an HTTP call between the two workers under
:mod:`workers.http.transfer_auth`'s rule (the bearer), as the byte path:

1. **Open, once per holder.** The receiver posts its :class:`DeviceIdentity` to the
   holder's ``POST /kv_transfer/ipc/open``. A holder on the same machine and GPU answers its
   pool's handle, its pool id (new each start) and its block layout; any other is answered
   409 (``no_cuda_ipc``: the holder's KV is not on CUDA; ``not_same_device``). The receiver
   checks the layout is its own, maps the pool, and keeps it for the holder's URL; a refusal
   or a failed open makes it use HTTP with that holder for :data:`RETRY_S` seconds.
2. **Read by key.** ``POST /kv_transfer/read`` with ``"transfer": "cuda_ipc"`` beside the
   keys: the holder pins the leading run it holds (as for a byte read), waits for its device,
   and answers ``{"pool": id, "pin": pin, "block_ids": [...], "lease_s": s}``: block ids,
   no bytes. A pool id other than the one mapped (the holder restarted) drops the mapping.
3. **Copy, then release.** The receiver copies those blocks into fresh blocks of its own
   (:meth:`~workers.engine.loop.Engine.receive_blocks`, as any receive) and posts
   ``{"pin": pin}`` to ``POST /kv_transfer/read/release``. A receiver that never releases
   costs the holder the pin for ``lease_s``; a copy that ends past half of ``lease_s``
   (measured from the answer, on the receiver's clock) is thrown away uncommitted, since the
   holder may have reused the blocks by then.

Any step that fails for a reason of this path (refused, not the same device, a handle that
does not open, an answer that does not parse) makes the same fetch use the byte path
(:mod:`workers.http.kv_fetch`); only the byte path's failure makes the request compute its
prompt. Failures the byte path would meet too (401, 403, 503, unreachable) are not retried.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from openai_request.bodies import ApiError
from workers.torch.kv_wire import KVLayout, TransferError

__all__ = ["OPEN_PATH", "RELEASE_PATH", "RETRY_S", "TRANSFER", "DeviceIdentity",
           "HolderIpc", "IpcBackend", "IpcPeers", "IpcRead", "MappedPool", "PinLeaseEnded",
           "ipc_writer", "parse_open_answer", "parse_read_answer"]

OPEN_PATH = "/kv_transfer/ipc/open"
RELEASE_PATH = "/kv_transfer/read/release"
#: The ``transfer`` a read names, and ``/model_info`` lists, for this path.
TRANSFER = "cuda_ipc"
#: Seconds a receiver uses HTTP with a holder that refused or failed this path.
RETRY_S = 300.0


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """Where a worker's KV lives: ``host`` (boot and IPC namespace, hashed) and ``gpu``
    (the device's UUID); :mod:`workers.torch.kv_ipc` reads them."""

    host: str
    gpu: str

    def as_json(self) -> dict[str, str]:
        """``{"host": ..., "gpu": ...}``."""
        return {"host": self.host, "gpu": self.gpu}

    @classmethod
    def from_json(cls, value: object) -> DeviceIdentity:
        """Parse :meth:`as_json`'s form.

        Raises:
            ValueError: not an object of two strings of 1..128 characters.
        """
        host = value.get("host") if isinstance(value, Mapping) else None
        gpu = value.get("gpu") if isinstance(value, Mapping) else None
        if not (isinstance(host, str) and isinstance(gpu, str) and 0 < len(host) <= 128
                and 0 < len(gpu) <= 128):
            raise ValueError("a device identity is {\"host\": \"...\", \"gpu\": \"...\"}, "
                             "strings of 1..128 characters")
        return cls(host, gpu)


class PinLeaseEnded(TransferError):
    """A copy ended too late to trust: the holder's pin on its blocks may have ended."""


class IpcBackend(Protocol):
    """What this module needs of a worker's KV storage (:class:`workers.torch.kv_ipc.CudaIpc`;
    tests give a fake that shares CPU tensors inside one process)."""

    def identity(self) -> tuple[str, str]:
        """This worker's machine and GPU (:class:`DeviceIdentity`'s fields)."""
        ...

    def export(self) -> dict[str, Any]:
        """The device pool's handle, as JSON."""
        ...

    def open(self, handle: Mapping[str, Any], blocks: int) -> Any:
        """The holder's pool of ``blocks`` blocks, mapped here (raises TransferError)."""
        ...

    def sync(self) -> None:
        """Wait for every kernel queued on this worker's device."""
        ...

    def copy(self, pool: Any, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the holder's blocks ``src`` into this worker's ``dst``; returns when done."""
        ...


def _layout_json(layout: KVLayout) -> dict[str, Any]:
    return {"dtype": layout.dtype, "block_shape": list(layout.block_shape)}


class HolderIpc:
    """The holder's side: its identity, its pool's handle (exported once, on the first
    open) and the open endpoint's answer.

    Args:
        backend: the CUDA IPC backend, or None (KV not on CUDA, or the path is off).
        layout: one block's layout.
        pool_blocks: blocks in the device pool (the scratch block included).
    """

    def __init__(self, backend: IpcBackend | None, layout: KVLayout | None,
                 pool_blocks: int) -> None:
        self.backend = backend
        self.layout = layout
        self.pool_blocks = pool_blocks
        #: Names this start's pool: a receiver that mapped another one maps again.
        self.pool_id = uuid.uuid4().hex
        self._handle: dict[str, Any] | None = None
        self._identity: DeviceIdentity | None = None

    @property
    def identity(self) -> DeviceIdentity | None:
        """This worker's machine and GPU, or None when it serves no CUDA IPC."""
        if self.backend is None:
            return None
        if self._identity is None:
            self._identity = DeviceIdentity(*self.backend.identity())
        return self._identity

    def open_answer(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The answer to ``POST /kv_transfer/ipc/open`` (module docstring, step 1).

        Raises:
            ApiError: 400 (no identity in the body) or 409 (``no_cuda_ipc``,
                ``not_same_device``).
        """
        try:
            peer = DeviceIdentity.from_json(body.get("device"))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="device") from None
        mine = self.identity
        if mine is None or self.backend is None or self.layout is None:
            raise ApiError(409, "this worker's KV is not on a CUDA device; read it over HTTP",
                           code="no_cuda_ipc")
        if peer != mine:
            raise ApiError(409, "this worker's KV is on another GPU or machine; read it over "
                           "HTTP", code="not_same_device")
        if self._handle is None:
            self._handle = self.backend.export()
        return {"pool": self.pool_id, "device": mine.as_json(), "blocks": self.pool_blocks,
                "layout": _layout_json(self.layout), "handle": self._handle}


@dataclass(frozen=True, slots=True)
class MappedPool:
    """A holder's pool as this receiver mapped it."""

    pool_id: str
    pool: Any
    blocks: int


@dataclass(frozen=True, slots=True)
class IpcRead:
    """A holder's answer to an IPC read: its pool, the pin to release, the blocks."""

    pool_id: str
    pin: str
    block_ids: tuple[int, ...]
    lease_s: float


def parse_read_answer(body: object, asked: int) -> IpcRead:
    """Check an IPC read's answer (module docstring, step 2).

    Raises:
        TransferError: a field missing or of another type, or more blocks than asked for.
    """
    if not isinstance(body, Mapping):
        raise TransferError("an IPC read's answer is a JSON object")
    pool, pin, ids, lease = (body.get("pool"), body.get("pin"), body.get("block_ids"),
                             body.get("lease_s"))
    if not isinstance(pool, str) or not isinstance(pin, str) or not isinstance(ids, list):
        raise TransferError("an IPC read's answer names its pool, pin and block_ids")
    if len(ids) > asked or any(type(b) is not int or b < 0 for b in ids):
        raise TransferError(f"an IPC read answers at most {asked} block ids, got {ids[:8]}")
    if not isinstance(lease, int | float) or isinstance(lease, bool) or not lease > 0:
        raise TransferError("an IPC read's answer gives its lease_s")
    return IpcRead(pool, pin, tuple(ids), float(lease))


def parse_open_answer(body: object, expect: KVLayout) -> tuple[str, Mapping[str, Any], int]:
    """The pool id, handle and block count of an open's answer, checked against this
    worker's layout.

    Raises:
        TransferError: a field missing or of another type, or another layout.
    """
    if not isinstance(body, Mapping):
        raise TransferError("an IPC open's answer is a JSON object")
    pool, handle, blocks, layout = (body.get("pool"), body.get("handle"), body.get("blocks"),
                                    body.get("layout"))
    if not isinstance(pool, str) or not isinstance(handle, Mapping) \
            or type(blocks) is not int or blocks < 1:
        raise TransferError("an IPC open's answer names its pool, handle and blocks")
    if layout != _layout_json(expect):
        raise TransferError(f"the holder's blocks are {layout}, this worker's "
                            f"{_layout_json(expect)}")
    return pool, handle, blocks


class IpcPeers:
    """The receiver's side: each holder's mapped pool, or until when it is read over HTTP.

    Args:
        backend: this worker's CUDA IPC backend, or None (then every holder is read over
            HTTP).
        clock: monotonic seconds.
    """

    def __init__(self, backend: IpcBackend | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self._clock = clock
        self._mapped: dict[str, MappedPool] = {}
        self._http_until: dict[str, float] = {}
        self._identity: DeviceIdentity | None = None

    @property
    def identity(self) -> DeviceIdentity | None:
        """This worker's machine and GPU, or None without a backend."""
        if self.backend is None:
            return None
        if self._identity is None:
            self._identity = DeviceIdentity(*self.backend.identity())
        return self._identity

    def usable(self, source: str) -> bool:
        """Whether to try this path with ``source`` now."""
        if self.backend is None:
            return False
        until = self._http_until.get(source)
        if until is None:
            return True
        if self._clock() >= until:
            del self._http_until[source]
            return True
        return False

    def mapped(self, source: str) -> MappedPool | None:
        """``source``'s pool, if mapped."""
        return self._mapped.get(source)

    def keep(self, source: str, pool: MappedPool) -> None:
        """Remember ``source``'s mapped pool."""
        self._mapped[source] = pool

    def forget(self, source: str) -> None:
        """Drop ``source``'s mapping (it restarted: another pool); the next fetch maps again."""
        self._mapped.pop(source, None)

    def use_http(self, source: str) -> None:
        """Read ``source`` over HTTP for :data:`RETRY_S` seconds (it refused, or failed)."""
        self._mapped.pop(source, None)
        self._http_until[source] = self._clock() + RETRY_S


def ipc_writer(backend: IpcBackend, pool: MappedPool, read: IpcRead, offset: int,
               deadline: float, clock: Callable[[], float] = time.monotonic
               ) -> Callable[[int, tuple[int, ...]], None]:
    """The :data:`~workers.engine.loop.WriteBlocks` that copies ``read``'s blocks, which are
    the prompt's blocks ``offset, offset + 1, ...``, from the holder's ``pool``.

    Raises (when called):
        TransferError: asked for a block before ``offset``; :class:`PinLeaseEnded`: the
            copy ended at or past ``deadline`` (the holder's pin may have ended: nothing is
            committed).
    """

    def write(first: int, block_ids: tuple[int, ...]) -> None:
        start = first - offset
        if start < 0:
            raise TransferError(f"block {first} is not in the read, which starts at block "
                                f"{offset}")
        backend.copy(pool.pool, read.block_ids[start:start + len(block_ids)], block_ids)
        if clock() >= deadline:
            raise PinLeaseEnded("the copy outlasted half of the holder's pin lease")

    return write
