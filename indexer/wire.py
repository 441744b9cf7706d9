"""The KV event wire format as kvroute workers publish it (see ``docs/wire.md``).

One definition, imported by the worker (to encode) and by the router and tools (frame
constants). The structs reproduce vLLM 0.33's ``vllm/distributed/kv_events.py`` byte for byte:
map-shaped events tagged by ``"type"``, fields in vLLM's order, fields that have a default
omitted when unset, then TensorRT-LLM's ``mm_keys`` and our ``trtllm_image_routing`` extension.
Golden vectors in ``tests/data/wire/`` pin the bytes.

Notes:
    1. New optional fields go at the end of a struct and get a default, so old consumers keep
       decoding (msgspec's schema-evolution rule).
    2. ``group_idx`` has no default in vLLM 0.33 and is therefore always written, although it
       follows optional fields; ``kw_only=True`` lets msgspec express that.
    3. The batch is ``array_like``: ``[ts, events, data_parallel_rank]``.

Transport framing lives here too, because both ends must agree on it: live messages are
``[topic, seq (8 bytes big-endian), payload]``; a replay request is ``[b"", start_seq]`` and a
replay reply ``[b"", topic, seq, payload]`` per batch, closed by :data:`REPLAY_END`.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "REPLAY_END_SEQ",
    "SEQ_LIMIT",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "MmKey",
    "encode_batch",
    "pack_seq",
    "unpack_seq",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

#: The seq frame that closes a replay reply (``ff`` x 8).
REPLAY_END_SEQ = b"\xff" * 8

#: A batch's sequence number is below this. A seq frame at or above it (the replay end marker
#: among them) carries no batch; consumers count it as malformed. Engines count from 0 by 1.
SEQ_LIMIT = 2**63

_SEQ = struct.Struct(">Q")


def pack_seq(seq: int) -> bytes:
    """Return the 8-byte big-endian frame for sequence number ``seq``.

    Raises:
        ValueError: ``seq`` is negative, or not below ``2**64 - 1`` (the end marker's value).
    """
    if not 0 <= seq < 2**64 - 1:
        raise ValueError(f"seq {seq} is out of range for a seq frame")
    return _SEQ.pack(seq)


def unpack_seq(frame: bytes) -> int:
    """Return the sequence number in an 8-byte big-endian frame.

    Raises:
        ValueError: the frame is not exactly 8 bytes.
    """
    if len(frame) != 8:
        raise ValueError(f"a seq frame is 8 bytes, got {len(frame)}")
    return _SEQ.unpack(frame)[0]


class MmKey(msgspec.Struct, tag_field="type", tag="mm_key", omit_defaults=True):
    """One multimodal item overlapping a block (TensorRT-LLM's ``mm_key``).

    ``hash`` is the item's hex content digest, ``start_offset`` the offset of the block's first
    position of this item within the item, ``uuid`` the routing hint when the worker holds one.
    """

    hash: str
    start_offset: int
    uuid: str | None = None


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """Full blocks committed to the cache, in chain order (vLLM 0.33 field order)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int | str]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None
    mm_keys: list[list[MmKey]] | None = None
    trtllm_image_routing: dict[str, int] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """Blocks evicted from one tier (``medium``)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """Everything the publisher held is gone."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=False):
    """``[ts, events, data_parallel_rank]``; kvroute always sends an int rank."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """Encode one batch as the msgpack payload frame."""
    return _encoder.encode(batch)
