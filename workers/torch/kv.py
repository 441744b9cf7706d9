"""The torch engine's KV storage: device blocks, the host tier in pinned memory, the copies.

Block ids are the cache manager's (:class:`~workers.cache.block_pool.BlockPool`): device block ``b``
is ``device_blocks[b]``, host block ``h`` is ``host_blocks[h]``. One allocation per tier, block
major: ``[num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim]``. Each layer sees
the view ``device_blocks[:, layer]`` (``[num_blocks, 2, block_size, kv_heads, head_dim]``),
and one block's KV over every layer is a single contiguous span, so an offload or onboard is
one memory copy per run of consecutive blocks rather than one per layer.

Ordering on CUDA (plain synchronous copies on the CPU):

1. Copies run on their own stream, in plan order: offloads of a transfer step before its
   onboards, steps in order (a later step may offload into a host block an earlier onboard
   still has to read: one stream keeps that order).
2. Before the first copy the copy stream waits for the compute stream, so an offload never
   reads a device block before the iteration that wrote it finished.
3. After the last copy the compute stream waits for the copy stream, so no kernel reads an
   onboarded block, or overwrites an offloaded one, before its copy completed.

One device block past the cache manager's, :attr:`PagedKV.scratch_block`, belongs to no
request: padded decode rows (:mod:`workers.torch.graphs`) write and read it.

Both tiers start zeroed, not uninitialised: attention multiplies padded and masked-out
positions by a zero weight, and zero times a NaN bit pattern left in fresh memory is NaN.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from workers.cache.block_pool import BlockCopy
from workers.engine.executor import BlockTransfer
from workers.torch.kv_wire import KVLayout, TransferError

__all__ = ["PagedKV", "bytes_per_block"]


def bytes_per_block(
    num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes on a tier: K and V of ``block_size`` positions in every layer."""
    return num_layers * 2 * block_size * kv_heads * head_dim * dtype.itemsize


class PagedKV:
    """Device and host KV blocks of one worker, and the copies between the tiers.

    Args:
        num_layers, block_size, kv_heads, head_dim: the shape of a block.
        num_blocks: device blocks (the cache manager's ``num_blocks``).
        host_blocks: host-tier blocks (0 for none); pinned when the device is CUDA.
        dtype: element type.
        device: where device blocks live.

    Raises:
        ValueError: the device has too little free memory for the blocks (CUDA out of memory).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        host_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        block = (num_layers, 2, block_size, kv_heads, head_dim)
        self.block_bytes = bytes_per_block(num_layers, block_size, kv_heads, head_dim, dtype)
        try:
            self.device_blocks = torch.zeros((num_blocks + 1, *block), dtype=dtype, device=device)
        except torch.cuda.OutOfMemoryError:
            raise ValueError(
                f"{num_blocks} KV blocks of {self.block_bytes} bytes "
                f"({num_blocks * self.block_bytes / 2**30:.2f} GiB) do not fit on {device}; "
                f"lower --kv-memory-gb"
            ) from None
        pin = device.type == "cuda"
        self.host_blocks = torch.zeros((host_blocks, *block), dtype=dtype, pin_memory=pin)
        self._cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self.copied_blocks = 0

    @property
    def num_blocks(self) -> int:
        """Device blocks the cache manager hands out (the scratch block not counted)."""
        return self.device_blocks.shape[0] - 1

    @property
    def scratch_block(self) -> int:
        """The device block no request owns, for padding (module docstring)."""
        return self.device_blocks.shape[0] - 1

    def layers(self) -> list[Tensor]:
        """Per layer, the view ``[num_blocks + 1, 2, block_size, kv_heads, head_dim]``."""
        return list(self.device_blocks.unbind(1))

    def rows(self) -> Tensor:
        """The device blocks (scratch included) as ``[blocks * layers * 2 * block_size,
        kv_heads * head_dim]`` rows of one position each: where the forward writes K/V (one
        ``index_copy_`` a layer and tensor, rather than a scatter through a strided per-layer
        view)."""
        return self.device_blocks.view(-1, self.device_blocks[0, 0, 0, 0].numel())

    def transfer(self, transfers: Sequence[BlockTransfer]) -> None:
        """Perform a plan's copies in order (module docstring: the ordering).

        On CUDA this returns once the copies are queued; work queued afterwards on the current
        stream runs after them.
        """
        if not any(t.offload or t.onboard for t in transfers):
            return
        if self._copy_stream is None:
            for t in transfers:
                self._copy(t.offload, self.device_blocks, self.host_blocks)
                self._copy(t.onboard, self.host_blocks, self.device_blocks)
            return
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            for t in transfers:
                self._copy(t.offload, self.device_blocks, self.host_blocks)
                self._copy(t.onboard, self.host_blocks, self.device_blocks)
        compute.wait_stream(self._copy_stream)

    def layout(self) -> KVLayout:
        """One block's dtype and shape, as a KV transfer names them
        (:mod:`workers.torch.kv_wire`)."""
        dtype = str(self.device_blocks.dtype).removeprefix("torch.")
        return KVLayout(dtype, tuple(self.device_blocks.shape[1:]))

    def read_blocks(self, block_ids: Sequence[int]) -> bytes:
        """The device blocks ``block_ids``, in that order, as one block-major byte string
        (a KV transfer's payload); waits for the device."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        blocks = self.device_blocks.index_select(0, index).cpu().contiguous()
        return blocks.view(torch.uint8).numpy().tobytes()

    def write_blocks(self, block_ids: Sequence[int], payload: bytes | memoryview) -> None:
        """Write a KV transfer's payload (block-major, :meth:`read_blocks`'s form) into the
        device blocks ``block_ids``, in that order; waits for the device.

        Raises:
            TransferError: the payload is not ``len(block_ids)`` blocks.
        """
        if len(payload) != len(block_ids) * self.block_bytes:
            raise TransferError(f"{len(payload)} bytes are not {len(block_ids)} blocks of "
                                f"{self.block_bytes}")
        if not block_ids:
            return
        shape = (len(block_ids), *self.device_blocks.shape[1:])
        data = torch.frombuffer(bytearray(payload), dtype=self.device_blocks.dtype).view(shape)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.device_blocks.index_copy_(0, index, data.to(self.device))
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _copy(self, copies: Iterable[BlockCopy], src: Tensor, dst: Tensor) -> None:
        for s, d, n in _runs(copies):
            dst[d : d + n].copy_(src[s : s + n], non_blocking=self._cuda)
            self.copied_blocks += n


def _runs(copies: Iterable[BlockCopy]) -> list[tuple[int, int, int]]:
    """Merge copies whose source and destination both continue the previous one's."""
    runs: list[list[int]] = []
    for c in copies:
        last = runs[-1] if runs else None
        if last is not None and c.src == last[0] + last[2] and c.dst == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([c.src, c.dst, 1])
    return [(s, d, n) for s, d, n in runs]
