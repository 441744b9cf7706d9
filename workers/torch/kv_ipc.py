"""The torch engine's KV over CUDA IPC: a peer on the same GPU copies blocks device to device.

Two torch workers on one GPU need not move KV through host memory. The holder exports its
whole device pool (:attr:`~workers.torch.kv.PagedKV.device_blocks`, one allocation) once, as
a CUDA IPC handle (:meth:`CudaIpc.export`, PyTorch's own ``_share_cuda_``, the handle
``torch.multiprocessing`` sends between processes); a receiver that proved itself opens it
once (:meth:`CudaIpc.open`) and, for each fetch, copies the blocks the holder names into its
own fresh blocks on a stream of its own (:meth:`CudaIpc.copy`: one ``index_select`` from the
holder's pool and one ``index_copy_`` into its own). The HTTP side
(:mod:`workers.http.kv_ipc`) says which blocks, pins them on the holder meanwhile, and falls
back to the byte message of :mod:`workers.torch.kv_wire` whenever this path cannot be used.

A handle is usable only on the same GPU of the same machine, in the same IPC namespace (its
reference counter lives in shared memory). :meth:`CudaIpc.identity` names both: a digest of
the kernel's boot id and this process's IPC namespace (:func:`host_key`), and the device's
UUID. Peers use IPC only when both match; a handle that still fails to open is a failure the
receiver falls back from.

Ordering: the holder waits for its device (:meth:`CudaIpc.sync`) before it names blocks, so
no kernel that writes them is still queued; the receiver's copy runs on its own stream and
waits for it before it commits the blocks. Pins (held by the holder until the receiver
releases them or their lease ends) keep the holder from reusing the blocks meanwhile.

This module imports torch but touches CUDA only when called: on a machine without CUDA,
:func:`cuda_ipc_for` answers None and nothing else runs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from workers.torch.kv_wire import TransferError

__all__ = ["CudaIpc", "cuda_ipc_for", "decode_handle", "encode_handle",
           "host_key"]

#: The fields of ``UntypedStorage._share_cuda_()``'s answer, in order; the ``bytes`` ones
#: travel as base64.
_HANDLE_FIELDS = (("device", int), ("handle", bytes), ("size", int), ("offset", int),
                  ("ref_counter_handle", bytes), ("ref_counter_offset", int),
                  ("event_handle", bytes), ("event_sync_required", bool))
#: A CUDA IPC handle is 64 bytes, a shared-memory name a few dozen.
_MAX_FIELD_BYTES = 1024


def host_key(boot_id: str | None = None, ipc_namespace: str | None = None) -> str:
    """A digest naming this machine's boot and this process's IPC namespace (the two a CUDA
    IPC handle depends on besides the GPU), read from ``/proc`` unless given; hashed, so
    ``/model_info`` shows neither."""
    if boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id = f.read().strip()
        except OSError:
            boot_id = ""
    if ipc_namespace is None:
        try:
            ipc_namespace = os.readlink("/proc/self/ns/ipc")
        except OSError:
            ipc_namespace = ""
    return hashlib.sha256(f"{boot_id}\0{ipc_namespace}".encode()).hexdigest()[:32]


def encode_handle(shared: Sequence[Any]) -> dict[str, Any]:
    """``_share_cuda_()``'s tuple as JSON (bytes as base64)."""
    if len(shared) != len(_HANDLE_FIELDS):
        raise ValueError(f"a CUDA IPC handle has {len(_HANDLE_FIELDS)} fields, got "
                         f"{len(shared)}")
    out: dict[str, Any] = {}
    for (name, kind), value in zip(_HANDLE_FIELDS, shared, strict=True):
        if kind is bytes:
            out[name] = base64.b64encode(bytes(value or b"")).decode()
        else:
            out[name] = kind(value)
    return out


def decode_handle(value: object) -> tuple[Any, ...]:
    """The tuple ``UntypedStorage._new_shared_cuda`` takes, from :func:`encode_handle`'s
    form (the device field is replaced by the opener's own).

    Raises:
        TransferError: a field missing, of another type, or too long.
    """
    if not isinstance(value, Mapping):
        raise TransferError("a CUDA IPC handle is a JSON object")
    out: list[Any] = []
    for name, kind in _HANDLE_FIELDS:
        field = value.get(name)
        if kind is bytes:
            if not isinstance(field, str) or len(field) > _MAX_FIELD_BYTES * 2:
                raise TransferError(f"the CUDA IPC handle's {name} is not base64")
            try:
                out.append(base64.b64decode(field, validate=True))
            except (binascii.Error, ValueError):
                raise TransferError(f"the CUDA IPC handle's {name} is not base64") from None
        elif kind is bool:
            if type(field) is not bool:
                raise TransferError(f"the CUDA IPC handle's {name} is not a boolean")
            out.append(field)
        else:
            if type(field) is not int or field < 0:
                raise TransferError(f"the CUDA IPC handle's {name} is not a count")
            out.append(field)
    if not out[1]:
        raise TransferError("the CUDA IPC handle names no memory")
    return tuple(out)


class CudaIpc:
    """CUDA IPC over one worker's :class:`~workers.torch.kv.PagedKV` (module docstring).

    Args:
        kv: the worker's KV storage, on a CUDA device.
    """

    def __init__(self, kv: Any) -> None:
        self._kv = kv
        self._device: torch.device = kv.device
        self._stream: Any = None

    def identity(self) -> tuple[str, str]:
        """This worker's machine (:func:`host_key`) and GPU (its UUID)."""
        props = torch.cuda.get_device_properties(self._device)
        return host_key(), str(props.uuid)

    def export(self) -> dict[str, Any]:
        """The device pool's handle, as JSON (the pool's shape goes beside it)."""
        storage = self._kv.device_blocks.untyped_storage()
        return encode_handle(storage._share_cuda_())

    def open(self, handle: Mapping[str, Any], blocks: int) -> Tensor:
        """The holder's pool of ``blocks`` blocks of this worker's layout, mapped here.

        Raises:
            TransferError: the handle does not decode, or does not open (another GPU or
                machine, or CUDA refused it).
        """
        fields = decode_handle(handle)
        shape = (blocks, *self._kv.device_blocks.shape[1:])
        dtype = self._kv.device_blocks.dtype
        need = blocks * self._kv.block_bytes
        if fields[2] < need:
            raise TransferError(f"the shared pool has {fields[2]} bytes, {blocks} blocks "
                                f"need {need}")
        index = self._device.index if self._device.index is not None \
            else torch.cuda.current_device()
        try:
            storage = torch.UntypedStorage._new_shared_cuda(index, *fields[1:])
        except RuntimeError as exc:
            raise TransferError(f"the holder's CUDA IPC handle did not open here: {exc}"
                                ) from None
        pool = torch.empty(0, dtype=dtype, device=self._device)
        pool.set_(storage, 0, shape, self._kv.device_blocks.stride())
        return pool

    def sync(self) -> None:
        """Wait for every kernel queued on this worker's device (the holder, before it names
        blocks a kernel may still be writing)."""
        torch.cuda.synchronize(self._device)

    def copy(self, pool: Tensor, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the holder's blocks ``src`` of ``pool`` into this worker's blocks ``dst``,
        in order, on this worker's transfer stream; returns when the copy is done.

        Raises:
            TransferError: the lists differ in length, or a source block is not in ``pool``.
        """
        if len(src) != len(dst):
            raise TransferError(f"{len(src)} source blocks for {len(dst)} destinations")
        if not src:
            return
        if max(src) >= pool.shape[0] or min(src) < 0:
            raise TransferError(f"a source block is outside the holder's {pool.shape[0]}")
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        blocks = self._kv.device_blocks
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            s = torch.tensor(list(src), dtype=torch.long).to(self._device, non_blocking=True)
            d = torch.tensor(list(dst), dtype=torch.long).to(self._device, non_blocking=True)
            blocks.index_copy_(0, d, pool.index_select(0, s))
        stream.synchronize()


def cuda_ipc_for(kv: Any) -> CudaIpc | None:
    """The CUDA IPC backend for ``kv`` (a :class:`~workers.torch.kv.PagedKV`), or None when
    its blocks are not on a CUDA device (CPU, the sim engine's None)."""
    if kv is None or getattr(kv, "device", None) is None or kv.device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return CudaIpc(kv)
