"""The torch engine's KV transfer message: a prefill worker's held blocks, as one binary body.

A decode worker pulls a held prefill with ``GET /kv_transfer/blocks/{remote_request_id}`` from
the prefill worker (:mod:`workers.http.kv_pull`); the answer's body is one message, every
integer big-endian::

    offset  size  field
    0       4     magic b"KVRB"
    4       2     version (1)
    6       4     header length H (at most MAX_HEADER_BYTES)
    10      H     header, UTF-8 JSON: {"dtype": "float32", "block_shape": [L, 2, B, K, D],
                  "blocks": N}
    10 + H  ...   payload: N blocks, each prod(block_shape) elements of dtype, block major,
                  exactly N * block_bytes bytes

The blocks are the prompt's first ``N`` full blocks, in prompt order (block ``i`` holds
positions ``[i * B, (i + 1) * B)``), laid out as one block of
:class:`~workers.torch.kv.PagedKV` (layers, K and V, positions, KV heads, head dim).

:func:`decode` checks every field against what the receiver expects (its own layout, at most
the blocks it asked for) before it trusts a byte of the payload: a message that is cut short,
too long, of another layout or another dtype is refused with :class:`TransferError`, whose
message says which. This module does no I/O and imports no torch.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

__all__ = ["DTYPE_BYTES", "MAGIC", "MAX_HEADER_BYTES", "VERSION", "KVLayout", "KVMessage",
           "TransferError", "decode", "encode", "header_bytes", "max_message_bytes"]

MAGIC = b"KVRB"
VERSION = 1
#: A header is a few dozen bytes; anything longer is not one.
MAX_HEADER_BYTES = 4096
#: The element types a block may hold, and their sizes.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

_PREFIX = struct.Struct(">4sHI")


class TransferError(ValueError):
    """A KV transfer that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one block is: its element type and shape (``[layers, 2, block_size, kv_heads,
    head_dim]``)."""

    dtype: str
    block_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise TransferError(f"unknown KV dtype {self.dtype!r} (not one of "
                                f"{', '.join(DTYPE_BYTES)})")
        if len(self.block_shape) != 5 or any(type(n) is not int or n < 1
                                             for n in self.block_shape):
            raise TransferError(f"a block shape is five positive sizes, got "
                                f"{list(self.block_shape)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block."""
        return math.prod(self.block_shape) * DTYPE_BYTES[self.dtype]

    @property
    def block_size(self) -> int:
        """Positions per block."""
        return self.block_shape[2]


@dataclass(frozen=True, slots=True)
class KVMessage:
    """A decoded message: ``blocks`` blocks of ``layout`` in ``payload``."""

    layout: KVLayout
    blocks: int
    payload: memoryview

    @property
    def tokens(self) -> int:
        """Prompt positions the blocks hold."""
        return self.blocks * self.layout.block_size


def header_bytes(layout: KVLayout, blocks: int) -> bytes:
    """The message's fixed part and header, which the payload follows."""
    header = json.dumps({"dtype": layout.dtype, "block_shape": list(layout.block_shape),
                         "blocks": blocks}, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header


def encode(layout: KVLayout, blocks: int, payload: bytes | memoryview) -> bytes:
    """One message of ``blocks`` blocks.

    Raises:
        TransferError: ``payload`` is not ``blocks`` blocks of ``layout``.
    """
    if blocks < 0 or len(payload) != blocks * layout.block_bytes:
        raise TransferError(f"{len(payload)} payload bytes are not {blocks} blocks of "
                            f"{layout.block_bytes} bytes")
    return header_bytes(layout, blocks) + bytes(payload)


def max_message_bytes(layout: KVLayout, blocks: int) -> int:
    """The most bytes a message of at most ``blocks`` blocks of ``layout`` can take."""
    return _PREFIX.size + MAX_HEADER_BYTES + blocks * layout.block_bytes


def decode(data: bytes | memoryview, expect: KVLayout, max_blocks: int) -> KVMessage:
    """Check and decode a message of at most ``max_blocks`` blocks of layout ``expect``.

    Raises:
        TransferError: the message is cut short, longer than it says, of another magic,
            version, dtype or block shape, or holds more than ``max_blocks`` blocks.
    """
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise TransferError(f"the message is cut short: {len(view)} bytes, less than its "
                            f"{_PREFIX.size}-byte prefix")
    magic, version, size = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise TransferError(f"not a KV transfer message (magic {bytes(magic)!r})")
    if version != VERSION:
        raise TransferError(f"KV transfer version {version}, this worker reads {VERSION}")
    if size > MAX_HEADER_BYTES:
        raise TransferError(f"a header of {size} bytes is longer than {MAX_HEADER_BYTES}")
    end = _PREFIX.size + size
    if len(view) < end:
        raise TransferError(f"the message is cut short in its header ({len(view)} of "
                            f"{end} bytes)")
    layout, blocks = _header(bytes(view[_PREFIX.size:end]))
    if layout.dtype != expect.dtype:
        raise TransferError(f"the blocks are {layout.dtype}, this worker's are {expect.dtype}")
    if layout.block_shape != expect.block_shape:
        raise TransferError(f"the blocks are shaped {list(layout.block_shape)}, this "
                            f"worker's {list(expect.block_shape)}")
    if blocks > max_blocks:
        raise TransferError(f"{blocks} blocks sent, at most {max_blocks} asked for")
    want = end + blocks * layout.block_bytes
    if len(view) != want:
        cut = "cut short" if len(view) < want else "longer than its header says"
        raise TransferError(f"the message is {cut}: {len(view)} bytes, its {blocks} blocks "
                            f"make {want}")
    return KVMessage(layout, blocks, view[end:])


def _header(raw: bytes) -> tuple[KVLayout, int]:
    try:
        header = json.loads(raw)
    except ValueError:
        raise TransferError("the header is not JSON") from None
    if not isinstance(header, dict):
        raise TransferError("the header is not a JSON object")
    dtype, shape, blocks = header.get("dtype"), header.get("block_shape"), header.get("blocks")
    if not isinstance(dtype, str) or not isinstance(shape, list):
        raise TransferError("the header needs a dtype string and a block_shape list")
    if type(blocks) is not int or blocks < 0:
        raise TransferError(f"the header's blocks must be a count, got {blocks!r}")
    return KVLayout(dtype, tuple(shape)), blocks
