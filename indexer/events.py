"""The normalised KV events every consumer works with, whatever engine sent them.

The lenient decoder (:mod:`indexer.decode`) turns each engine's shape (vLLM map or legacy array
events, TensorRT-LLM, SGLang) into these three facts. Block hashes are unsigned 64-bit ints:
signed values are masked with ``2**64 - 1`` and a raw-bytes hash is read as vLLM reads its
digest, the last 8 bytes big-endian. Token ids are ``int`` or ``str``; a ``str`` is the hex
content digest of a multimodal item at that position.

Fields that carry no information in a given engine's shape stay at their defaults (``None``),
so a consumer can tell "absent" from any value: ``medium is None`` means the engine did not say
and is to be treated as the device tier (:func:`tier_of`).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "U64_MASK",
    "Batch",
    "BlockHash",
    "Cleared",
    "Event",
    "MmItem",
    "Removed",
    "Stored",
    "Tier",
    "tier_of",
]

BlockHash = int
U64_MASK = (1 << 64) - 1


class Tier:
    """Where a block is resident. Device and host are the two tiers the index tracks."""

    DEVICE = 0
    HOST = 1


# Mediums as engines name them. Storage and disk tiers are slower than host memory; the index
# treats everything off the device as the host tier (a hit there still beats a recompute).
_DEVICE_MEDIUMS = frozenset({"GPU", "gpu", "cuda", "CUDA", "device"})


def tier_of(medium: str | None) -> int:
    """Return the :class:`Tier` for an engine's ``medium`` (absent means the device)."""
    if medium is None or medium in _DEVICE_MEDIUMS:
        return Tier.DEVICE
    return Tier.HOST


class MmItem(msgspec.Struct, frozen=True):
    """A multimodal item overlapping a block: content digest, offset within it, routing hint."""

    hash: str
    start_offset: int
    uuid: str | None = None


class Stored(msgspec.Struct):
    """``BlockStored``: full blocks committed in chain order under ``parent_block_hash``.

    ``token_ids`` holds ``len(block_hashes) * block_size`` entries. ``mm_keys``, when present,
    has one entry per block (possibly empty). ``extra_keys`` is vLLM's per-block list, kept as
    sent; ``cache_salt`` is SGLang's top-level salt.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int | str]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    mm_keys: list[list[MmItem]] | None = None
    trtllm_image_routing: dict[str, Any] | None = None
    cache_salt: str | None = None


class Removed(msgspec.Struct):
    """``BlockRemoved``: blocks evicted from the tier named by ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class Cleared(msgspec.Struct):
    """``AllBlocksCleared``: everything the publisher (and rank) held is gone."""


Event = Stored | Removed | Cleared


class Batch(msgspec.Struct):
    """One decoded batch: the engine's timestamp, its prefix-cache events, and its rank."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
