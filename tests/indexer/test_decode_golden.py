"""Every golden payload in tests/data/wire decodes to its meaning; our encoder round-trips it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from indexer.decode import DecodeStats, MalformedBatch, decode_batch, normalise_hash
from indexer.events import Cleared, MmItem, Removed, Stored
from indexer.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    MmKey,
    encode_batch,
)

_NAMES = {Stored: "BlockStored", Removed: "BlockRemoved", Cleared: "AllBlocksCleared"}


def as_meaning(event: Stored | Removed | Cleared, keys: set[str]) -> dict[str, Any]:
    """The decoded event in the golden file's terms: keys the case names, compared exactly;
    every other field must be unset (None). ``lora_id`` is deprecated in vLLM and the golden
    meanings leave it out, so it is checked by the round-trip test instead."""
    fields = msgspec.to_builtins(event)
    unset = {k for k, v in fields.items() if k not in keys | {"lora_id"} and v is not None}
    assert not unset, f"fields decoded but absent from the meaning: {unset}"
    return {"type": _NAMES[type(event)], **{k: v for k, v in fields.items() if k in keys}}


def test_every_case_is_covered(golden_payloads: list[dict[str, Any]]) -> None:
    assert len(golden_payloads) == 13


@pytest.mark.parametrize("index", range(13))
def test_golden_payload_decodes_to_meaning(golden_payloads: list[dict[str, Any]],
                                           index: int) -> None:
    case = golden_payloads[index]
    payload, meaning = bytes.fromhex(case["payload_hex"]), case["meaning"]
    stats = DecodeStats()
    if meaning.get("error"):
        with pytest.raises(MalformedBatch):
            decode_batch(payload, stats)
        assert stats.batches == 0
        return
    batch = decode_batch(payload, stats)
    assert batch.ts == meaning.get("ts", batch.ts)
    assert batch.data_parallel_rank == meaning.get("data_parallel_rank", 0)
    expected = meaning.get("events", [])
    got = [as_meaning(e, set(m) - {"type"}) for e, m in zip(batch.events, expected, strict=False)]
    assert got == expected
    assert len(batch.events) == len(expected)


def test_unknown_event_type_is_counted_not_fatal(golden_payloads: list[dict[str, Any]]) -> None:
    case = next(c for c in golden_payloads if c["name"] == "bad_unknown_event_type")
    stats = DecodeStats()
    batch = decode_batch(bytes.fromhex(case["payload_hex"]), stats)
    assert batch.events == []
    assert (stats.unknown_events, stats.batches) == (1, 1)


def test_sliding_window_group_is_ignored_and_counted(
        golden_payloads: list[dict[str, Any]]) -> None:
    case = next(c for c in golden_payloads if "sliding_window" in c["name"])
    stats = DecodeStats()
    assert decode_batch(bytes.fromhex(case["payload_hex"]), stats).events == []
    assert stats.ignored_events == 1


def _wire_event(meaning: dict[str, Any]) -> BlockStored | BlockRemoved | AllBlocksCleared:
    fields = {k: v for k, v in meaning.items() if k != "type"}
    if meaning["type"] == "AllBlocksCleared":
        return AllBlocksCleared()
    if meaning["type"] == "BlockRemoved":
        return BlockRemoved(**fields)
    fields.setdefault("lora_id", None)
    fields.setdefault("lora_name", None)
    fields.setdefault("group_idx", 0)
    if "mm_keys" in fields:
        fields["mm_keys"] = [[MmKey(**k) for k in per] for per in fields["mm_keys"]]
    return BlockStored(**fields)


# Cases whose bytes our encoder must reproduce exactly: vLLM 0.33's own output.
_VLLM_033 = ["vllm033_stored_two_blocks", "vllm033_removed_then_cleared",
             "vllm033_empty_batch_nil_rank", "vllm033_cpu_tier_store"]


@pytest.mark.parametrize("name", _VLLM_033)
def test_encoder_reproduces_vllm_bytes(golden_payloads: list[dict[str, Any]], name: str) -> None:
    case = next(c for c in golden_payloads if c["name"] == name)
    meaning = case["meaning"]
    batch = KVEventBatch(meaning["ts"], [_wire_event(m) for m in meaning["events"]],
                         meaning["data_parallel_rank"])
    assert encode_batch(batch).hex() == case["payload_hex"]


def test_encoder_reproduces_vllm_lora_salt_bytes(golden_payloads: list[dict[str, Any]]) -> None:
    case = next(c for c in golden_payloads if c["name"] == "vllm033_stored_child_lora_mm_salt")
    event = BlockStored(block_hashes=[9], parent_block_hash=5, token_ids=[1, 2, 3, 4],
                        block_size=4, lora_id=3, medium="GPU", lora_name="sql-adapter",
                        extra_keys=[["sql-adapter", ["a" * 64, 2], "tenant-salt"]],
                        group_idx=0, kv_cache_spec_kind="full_attention")
    assert encode_batch(KVEventBatch(2.0, [event], 1)).hex() == case["payload_hex"]


@pytest.mark.parametrize("index", range(9))
def test_our_encoding_decodes_to_the_same_meaning(golden_payloads: list[dict[str, Any]],
                                                  index: int) -> None:
    case = golden_payloads[index]
    original = decode_batch(bytes.fromhex(case["payload_hex"]))
    events = []
    for e in original.events:
        if isinstance(e, Stored):
            mm = None if e.mm_keys is None else [
                [MmKey(hash=i.hash, start_offset=i.start_offset, uuid=i.uuid) for i in per]
                for per in e.mm_keys]
            events.append(BlockStored(
                block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                token_ids=e.token_ids, block_size=e.block_size, lora_id=e.lora_id,
                medium=e.medium, lora_name=e.lora_name, extra_keys=e.extra_keys,
                group_idx=e.group_idx or 0, kv_cache_spec_kind=e.kv_cache_spec_kind,
                mm_keys=mm, trtllm_image_routing=e.trtllm_image_routing))
        elif isinstance(e, Removed):
            events.append(BlockRemoved(block_hashes=e.block_hashes, medium=e.medium,
                                       group_idx=e.group_idx or 0))
        else:
            events.append(AllBlocksCleared())
    again = decode_batch(encode_batch(KVEventBatch(original.ts, events,
                                                   original.data_parallel_rank)))
    assert again.ts == original.ts
    assert again.data_parallel_rank == original.data_parallel_rank
    for before, after in zip(original.events, again.events, strict=True):
        b, a = msgspec.to_builtins(before), msgspec.to_builtins(after)
        if isinstance(before, Stored | Removed):
            b["group_idx"] = b["group_idx"] or 0  # we always write group 0
        if isinstance(before, Stored):
            b["cache_salt"] = None  # SGLang's top-level salt is not ours to send
        assert a == b


# -- lenient decoding beyond the golden files ----------------------------------------------

def _payload(events: list[Any], *extra: Any) -> bytes:
    return msgspec.msgpack.encode([1.0, events, *extra])


def test_two_element_batch_has_unknown_rank() -> None:
    assert decode_batch(_payload([])).data_parallel_rank is None


@pytest.mark.parametrize("raw, expected", [
    (-1, 2**64 - 1), (5, 5), (2**64 - 1, 2**64 - 1),
    (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
])
def test_hashes_normalise_to_unsigned_64(raw: Any, expected: int) -> None:
    assert normalise_hash(raw) == expected
    stored = {"type": "BlockStored", "block_hashes": [raw], "parent_block_hash": raw,
              "token_ids": [1], "block_size": 1}
    event = decode_batch(_payload([stored], 0)).events[0]
    assert isinstance(event, Stored)
    assert event.block_hashes == [expected] and event.parent_block_hash == expected


def test_str_tokens_and_mm_keys_decode() -> None:
    digest = "ab" * 32
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": [digest, 7], "block_size": 2,
              "mm_keys": [[{"type": "mm_key", "hash": digest, "start_offset": 3}]]}
    event = decode_batch(_payload([stored], 0)).events[0]
    assert isinstance(event, Stored)
    assert event.token_ids == [digest, 7]
    assert event.mm_keys == [[MmItem(digest, 3, None)]]


@pytest.mark.parametrize("bad_event, reason", [
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
      "token_ids": [1, 2, 3], "block_size": 2}, "token count is not blocks x block_size"),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
      "token_ids": [1.5, 2], "block_size": 2}, "a float token"),
    ({"type": "BlockStored", "block_hashes": "x", "parent_block_hash": None,
      "token_ids": [], "block_size": 2}, "hashes not a list"),
    ({"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2},
     "no parent_block_hash field"),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
      "token_ids": [1, 2], "block_size": 0}, "block_size 0"),
    ({"type": "BlockRemoved"}, "no block_hashes"),
    ({"type": "BlockRemoved", "block_hashes": [None]}, "nil hash"),
    ({"type": "BlockRemoved", "block_hashes": [1], "medium": 3}, "medium not a str"),
    (42, "an event that is neither map nor array"),
])
def test_malformed_event_is_counted_and_the_rest_applies(bad_event: Any, reason: str) -> None:
    good = {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}
    stats = DecodeStats()
    batch = decode_batch(_payload([bad_event, good], 0), stats)
    assert batch.events == [Removed([9], "GPU")], reason
    assert stats.malformed_events == 1, reason


def test_unknown_keys_are_counted_and_ignored() -> None:
    stats = DecodeStats()
    event = {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU", "future": 1}
    assert decode_batch(_payload([event]), stats).events == [Removed([9], "GPU")]
    assert stats.unknown_keys == 1


def test_array_and_map_events_mix_in_one_batch() -> None:
    batch = decode_batch(_payload([["BlockRemoved", [3], "CPU"], {"type": "AllBlocksCleared"},
                                   ["AllBlocksCleared"]], 1))
    assert batch.events == [Removed([3], "CPU"), Cleared(), Cleared()]


@pytest.mark.parametrize("payload, reason", [
    (b"", "empty"),
    (msgspec.msgpack.encode([1.0]), "one element"),
    (msgspec.msgpack.encode([1.0, [], 0, 0]), "four elements"),
    (msgspec.msgpack.encode(["x", []]), "ts not a number"),
    (msgspec.msgpack.encode([1.0, {}]), "events not an array"),
    (msgspec.msgpack.encode([1.0, [], "r"]), "rank not an int"),
    (msgspec.msgpack.encode({"ts": 1.0}), "a map"),
])
def test_malformed_envelope_raises_the_one_error(payload: bytes, reason: str) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(payload)
