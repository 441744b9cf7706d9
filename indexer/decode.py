"""Lenient decoding of KV event payloads from any engine into :mod:`indexer.events`.

The rule (``docs/wire.md``): decode the envelope strictly and each event leniently.

- Envelope: a msgpack array ``[ts, events]`` or ``[ts, events, rank]``. Anything else (not
  msgpack, truncated, nested past the decoder's depth, a map, wrong types) raises
  :class:`MalformedBatch`, the one error type.
- Events: map-shaped (``{"type": ..., ...}``) or array-shaped (``["BlockStored", ...]``), mixed
  freely in a batch. An unknown event type, an unknown key, or an event whose fields have the
  wrong types is skipped and counted in :class:`DecodeStats`; the rest of the batch applies.
- Events that do not describe the reusable prefix cache (``group_idx`` other than 0, or a
  ``kv_cache_spec_kind`` other than full or MLA attention) are dropped and counted as ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from indexer.events import U64_MASK, Batch, Cleared, Event, MmItem, Removed, Stored

__all__ = ["DecodeStats", "MalformedBatch", "decode_batch", "normalise_hash"]


class MalformedBatch(ValueError):
    """A payload whose envelope is not a KV event batch; the whole payload is unusable."""


class DecodeStats:
    """Counters of what the decoder skipped; one instance accumulates over many batches."""

    __slots__ = ("batches", "events", "ignored_events", "malformed_events", "unknown_events",
                 "unknown_keys")

    def __init__(self) -> None:
        self.batches = 0
        self.events = 0
        self.unknown_events = 0
        self.unknown_keys = 0
        self.malformed_events = 0
        self.ignored_events = 0

    def as_dict(self) -> dict[str, int]:
        """Return the counters by name."""
        return {name: getattr(self, name) for name in self.__slots__}


_PREFIX_KINDS = frozenset({"full_attention", "mla_attention"})

_STORED_KEYS = frozenset({
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids", "mm_keys", "trtllm_image_routing", "cache_salt",
})
_REMOVED_KEYS = frozenset({"type", "block_hashes", "medium", "group_idx", "locality",
                           "ownership"})
_CLEARED_KEYS = frozenset({"type"})

# Positions of fields in legacy (vLLM <= 0.23) array-shaped events, after the type name.
_STORED_ARRAY_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                        "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                        "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_ARRAY_FIELDS = ("block_hashes", "medium", "group_idx")

_decoder = msgspec.msgpack.Decoder()


class _BadEvent(Exception):
    """Raised inside the decoder for one event whose fields are unusable."""


def normalise_hash(value: Any) -> int:
    """Return an engine block hash as unsigned 64-bit.

    Signed or unsigned ints are masked to 64 bits; a bytes hash is read as vLLM reads its
    digest (the last 8 bytes, big-endian).

    Raises:
        TypeError: the value is neither int nor bytes.
    """
    if type(value) is int:
        return value & U64_MASK
    if isinstance(value, bytes | bytearray | memoryview):
        return int.from_bytes(bytes(value)[-8:], "big")
    raise TypeError(f"a block hash is an int or bytes, not {type(value).__name__}")


def _hashes(value: Any) -> list[int]:
    if type(value) is not list:
        raise _BadEvent("block_hashes is not a list")
    try:
        return [h & U64_MASK if type(h) is int else normalise_hash(h) for h in value]
    except TypeError as exc:
        raise _BadEvent(str(exc)) from None


def _optional(value: Any, kind: type, name: str) -> Any:
    if value is not None and type(value) is not kind:
        raise _BadEvent(f"{name} is not {kind.__name__}")
    return value


_token_list = list[int | str]


def _stored(fields: dict[str, Any]) -> Stored:
    try:
        hashes = _hashes(fields["block_hashes"])
        parent = fields["parent_block_hash"]
        tokens = fields["token_ids"]
        block_size = fields["block_size"]
    except KeyError as exc:
        raise _BadEvent(f"BlockStored lacks {exc.args[0]}") from None
    if parent is not None:
        try:
            parent = normalise_hash(parent)
        except TypeError as exc:
            raise _BadEvent(str(exc)) from None
    if type(block_size) is not int or block_size <= 0:
        raise _BadEvent("block_size is not a positive int")
    if type(tokens) is not list:
        raise _BadEvent("token_ids is not a list")
    try:
        tokens = msgspec.convert(tokens, _token_list)
    except msgspec.ValidationError as exc:
        raise _BadEvent(f"token_ids: {exc}") from None
    if len(tokens) != len(hashes) * block_size:
        raise _BadEvent(f"{len(tokens)} token_ids for {len(hashes)} blocks of {block_size}")
    mm_keys = fields.get("mm_keys")
    if mm_keys is not None:
        mm_keys = _mm_keys(mm_keys, len(hashes))
    routing = fields.get("trtllm_image_routing")
    if routing is not None and type(routing) is not dict:
        raise _BadEvent("trtllm_image_routing is not a map")
    extra = fields.get("extra_keys")
    if extra is not None and type(extra) is not list:
        raise _BadEvent("extra_keys is not a list")
    return Stored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        medium=_optional(fields.get("medium"), str, "medium"),
        lora_name=_optional(fields.get("lora_name"), str, "lora_name"),
        lora_id=_optional(fields.get("lora_id"), int, "lora_id"),
        extra_keys=extra,
        group_idx=_optional(fields.get("group_idx"), int, "group_idx"),
        kv_cache_spec_kind=_optional(fields.get("kv_cache_spec_kind"), str,
                                     "kv_cache_spec_kind"),
        mm_keys=mm_keys,
        trtllm_image_routing=routing,
        cache_salt=_optional(fields.get("cache_salt"), str, "cache_salt"),
    )


def _mm_keys(value: Any, blocks: int) -> list[list[MmItem]]:
    if type(value) is not list or len(value) != blocks:
        raise _BadEvent("mm_keys is not a list with one entry per block")
    out: list[list[MmItem]] = []
    for per_block in value:
        items: list[MmItem] = []
        for key in per_block or ():
            if type(key) is not dict:
                raise _BadEvent("an mm_key is not a map")
            digest, offset, uuid = key.get("hash"), key.get("start_offset", 0), key.get("uuid")
            if type(digest) is not str or type(offset) is not int or offset < 0:
                raise _BadEvent("an mm_key lacks a str hash or an int start_offset")
            if uuid is not None and type(uuid) is not str:
                raise _BadEvent("an mm_key uuid is not a str")
            items.append(MmItem(digest, offset, uuid))
        out.append(items)
    return out


def _removed(fields: dict[str, Any]) -> Removed:
    if "block_hashes" not in fields:
        raise _BadEvent("BlockRemoved lacks block_hashes")
    return Removed(
        block_hashes=_hashes(fields["block_hashes"]),
        medium=_optional(fields.get("medium"), str, "medium"),
        group_idx=_optional(fields.get("group_idx"), int, "group_idx"),
    )


def _is_prefix_state(event: Stored | Removed) -> bool:
    if event.group_idx not in (None, 0):
        return False
    kind = getattr(event, "kv_cache_spec_kind", None)
    return kind is None or kind in _PREFIX_KINDS


def _event(raw: Any, stats: DecodeStats) -> Event | None:
    if type(raw) is dict:
        kind = raw.get("type")
        known = {"BlockStored": _STORED_KEYS, "BlockRemoved": _REMOVED_KEYS,
                 "AllBlocksCleared": _CLEARED_KEYS}.get(kind) if isinstance(kind, str) else None
        if known is None:
            stats.unknown_events += 1
            return None
        stats.unknown_keys += len(raw.keys() - known)
        fields = raw
    elif type(raw) is list and raw and type(raw[0]) is str:
        kind = raw[0]
        names = {"BlockStored": _STORED_ARRAY_FIELDS, "BlockRemoved": _REMOVED_ARRAY_FIELDS,
                 "AllBlocksCleared": ()}.get(kind)
        if names is None:
            stats.unknown_events += 1
            return None
        # Legacy arrays write every field; nil means unset, as an omitted map key does.
        fields = {n: v for n, v in zip(names, raw[1:], strict=False) if v is not None}
        if kind == "BlockStored":
            fields.setdefault("parent_block_hash", None)
    else:
        stats.malformed_events += 1
        return None
    if kind == "AllBlocksCleared":
        return Cleared()
    try:
        event = _stored(fields) if kind == "BlockStored" else _removed(fields)
    except _BadEvent:
        stats.malformed_events += 1
        return None
    if not _is_prefix_state(event):
        stats.ignored_events += 1
        return None
    return event


def decode_batch(payload: bytes, stats: DecodeStats | None = None) -> Batch:
    """Decode one payload frame into a normalised :class:`~indexer.events.Batch`.

    Args:
        payload: the msgpack payload frame.
        stats: counters to accumulate into (skipped events, unknown keys); optional.

    Returns:
        The batch with its usable prefix-cache events, in order.

    Raises:
        MalformedBatch: the envelope is not a 2- or 3-element ``[ts, events, rank]`` array.
    """
    if stats is None:
        stats = DecodeStats()
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, TypeError) as exc:
        raise MalformedBatch(f"payload is not msgpack: {exc}") from None
    except RecursionError:
        raise MalformedBatch("payload is nested too deeply") from None
    if type(raw) is not list or len(raw) not in (2, 3):
        raise MalformedBatch("a batch is a msgpack array [ts, events, rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if type(ts) not in (float, int) or type(events) is not list:
        raise MalformedBatch("batch ts is not a number or events is not an array")
    if rank is not None and type(rank) is not int:
        raise MalformedBatch("batch data_parallel_rank is not an int or nil")
    out: list[Event] = []
    for item in events:
        event = _event(item, stats)
        if event is not None:
            out.append(event)
    stats.batches += 1
    stats.events += len(out)
    return Batch(ts=float(ts), events=out, data_parallel_rank=rank)
