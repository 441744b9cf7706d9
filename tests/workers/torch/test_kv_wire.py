"""The torch engine's KV transfer message: framing, and every malformed form refused with a
TransferError that says what is wrong, before a payload byte is trusted."""

from __future__ import annotations

import json
import struct

import pytest

from workers.torch.kv_wire import (
    MAGIC,
    MAX_HEADER_BYTES,
    VERSION,
    KVLayout,
    TransferError,
    decode,
    encode,
    header_bytes,
    max_message_bytes,
)

LAYOUT = KVLayout("float32", (2, 2, 4, 2, 16))  # 2 layers, K and V, 4 positions, 2 heads
BLOCK = LAYOUT.block_bytes


def _payload(blocks: int) -> bytes:
    return bytes((i * 7) % 251 for i in range(blocks * BLOCK))


def _raw(header: dict[str, object], payload: bytes = b"", version: int = VERSION,
         magic: bytes = MAGIC) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack(">4sHI", magic, version, len(text)) + text + payload


def test_a_message_round_trips_its_blocks_in_order() -> None:
    assert BLOCK == 2 * 2 * 4 * 2 * 16 * 4
    payload = _payload(3)
    message = decode(encode(LAYOUT, 3, payload), LAYOUT, max_blocks=5)
    assert (message.layout, message.blocks, message.tokens) == (LAYOUT, 3, 12)
    assert bytes(message.payload) == payload
    assert bytes(message.payload[BLOCK:2 * BLOCK]) == payload[BLOCK:2 * BLOCK]
    empty = decode(encode(LAYOUT, 0, b""), LAYOUT, max_blocks=5)
    assert (empty.blocks, len(empty.payload)) == (0, 0)
    assert len(encode(LAYOUT, 5, _payload(5))) <= max_message_bytes(LAYOUT, 5)


def test_a_payload_that_is_not_whole_blocks_is_not_encoded() -> None:
    with pytest.raises(TransferError, match="not 2 blocks"):
        encode(LAYOUT, 2, _payload(2)[:-1])


def test_a_message_cut_anywhere_is_refused_as_cut_short() -> None:
    whole = encode(LAYOUT, 2, _payload(2))
    head = len(header_bytes(LAYOUT, 2))
    for cut in (0, 3, 9, head - 1, head, head + 1, len(whole) - 1):
        with pytest.raises(TransferError, match="cut short"):
            decode(whole[:cut], LAYOUT, max_blocks=2)


def test_bytes_past_the_blocks_it_names_are_refused() -> None:
    with pytest.raises(TransferError, match="longer than its header says"):
        decode(encode(LAYOUT, 2, _payload(2)) + b"\0", LAYOUT, max_blocks=2)


def test_more_blocks_than_asked_for_are_refused() -> None:
    with pytest.raises(TransferError, match="3 blocks sent, at most 2"):
        decode(encode(LAYOUT, 3, _payload(3)), LAYOUT, max_blocks=2)


@pytest.mark.parametrize(("sent", "reason"), [
    (KVLayout("bfloat16", LAYOUT.block_shape), "are bfloat16, this worker's are float32"),
    (KVLayout("float32", (2, 2, 8, 2, 16)), r"shaped \[2, 2, 8, 2, 16\]"),
    (KVLayout("float32", (3, 2, 4, 2, 16)), r"shaped \[3, 2, 4, 2, 16\]"),
])
def test_blocks_of_another_dtype_or_shape_are_refused(sent: KVLayout, reason: str) -> None:
    with pytest.raises(TransferError, match=reason):
        decode(encode(sent, 1, bytes(sent.block_bytes)), LAYOUT, max_blocks=4)


@pytest.mark.parametrize(("raw", "reason"), [
    (_raw({"dtype": "float32"}, magic=b"HTTP"), "not a KV transfer message"),
    (_raw({"dtype": "float32"}, version=2), "version 2, this worker reads 1"),
    (struct.pack(">4sHI", MAGIC, VERSION, MAX_HEADER_BYTES + 1), "longer than 4096"),
    (struct.pack(">4sHI", MAGIC, VERSION, 3) + b"{x]", "not JSON"),
    (_raw([1, 2]), "not a JSON object"),  # type: ignore[arg-type]
    (_raw({"dtype": 4, "block_shape": [2, 2, 4, 2, 16], "blocks": 1}), "dtype string"),
    (_raw({"dtype": "float32", "block_shape": [2, 2, 4, 2, 16], "blocks": -1}), "a count"),
    (_raw({"dtype": "float32", "block_shape": [2, 2, 4, 2, 16], "blocks": True}), "a count"),
    (_raw({"dtype": "int8", "block_shape": [2, 2, 4, 2, 16], "blocks": 0}), "unknown KV dtype"),
    (_raw({"dtype": "float32", "block_shape": [2, 2, 4, 0, 16], "blocks": 0}), "five positive"),
    (_raw({"dtype": "float32", "block_shape": [2, 2, 4], "blocks": 0}), "five positive"),
])
def test_a_malformed_header_is_refused_saying_what_is_wrong(raw: bytes, reason: str) -> None:
    with pytest.raises(TransferError, match=reason):
        decode(raw, LAYOUT, max_blocks=4)


def test_a_huge_block_count_is_refused_before_its_payload_is_looked_for() -> None:
    raw = _raw({"dtype": "float32", "block_shape": list(LAYOUT.block_shape), "blocks": 1 << 40})
    with pytest.raises(TransferError, match="at most 4"):
        decode(raw, LAYOUT, max_blocks=4)
