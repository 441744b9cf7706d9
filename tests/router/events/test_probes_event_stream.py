"""Probes of the event stream as the router takes it: live frames whose payloads are not
msgpack, envelopes of the wrong shape, events with wrong types, huge payloads and huge
counts, hashes past 64 bits, then what decodes applied to the prefix index (the compiled one
and the reference). For every probe: the sequencer raises nothing, the payload is delivered
or counted malformed, the index takes what was delivered without raising, and the stream
goes on (the next good batch is delivered)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from indexer import radix
from indexer.index import PrefixIndex
from indexer.wire import REPLAY_END_SEQ, pack_seq
from router.events.sequencer import Delivered, MalformedInput, ReplayRequest, StreamSequencer
from tests.router.events.test_sequencer import payload

pack = msgspec.msgpack.encode


def stored(**fields: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": list(range(16)), "block_size": 16, "lora_id": None,
            "medium": "GPU", **fields}


PAYLOADS: dict[str, Callable[[], bytes]] = {
    "empty": lambda: b"",
    "not msgpack": lambda: b"\xc1\xc1\xc1",
    "truncated": lambda: payload(1)[:-3],
    "a map envelope": lambda: pack({"ts": 1, "events": []}),
    "an int envelope": lambda: pack(7),
    "an envelope of one": lambda: pack([1.0]),
    "an envelope of four": lambda: pack([1.0, [], 0, "x"]),
    "events not a list": lambda: pack([1.0, "events"]),
    "a NaN timestamp": lambda: pack([float("nan"), []]),
    "a string timestamp": lambda: pack(["now", []]),
    "a rank that is a string": lambda: pack([1.0, [], "zero"]),
    "a negative rank": lambda: pack([1.0, [], -1]),
    "an unknown event": lambda: pack([1.0, [{"type": "BlockExploded"}]]),
    "an event that is a number": lambda: pack([1.0, [5]]),
    "hashes as a string": lambda: pack([1.0, [stored(block_hashes="abc")]]),
    "a hash of 2**70": lambda: pack([1.0, [stored(block_hashes=[2**64 - 1])]]),
    "a negative hash": lambda: pack([1.0, [stored(block_hashes=[-5])]]),
    "a hash as bytes of 100": lambda: pack([1.0, [stored(block_hashes=[b"x" * 100])]]),
    "token ids as floats": lambda: pack([1.0, [stored(token_ids=[0.5] * 16)]]),
    "too few token ids": lambda: pack([1.0, [stored(token_ids=[1, 2])]]),
    "a zero block size": lambda: pack([1.0, [stored(block_size=0)]]),
    "a negative block size": lambda: pack([1.0, [stored(block_size=-16)]]),
    "a parent that is a list": lambda: pack([1.0, [stored(parent_block_hash=[1, 2])]]),
    "a removal of a string": lambda: pack([1.0, [{"type": "BlockRemoved",
                                                  "block_hashes": "all"}]]),
    "100,000 removals": lambda: pack([1.0, [{"type": "BlockRemoved",
                                            "block_hashes": list(range(100_000))}]]),
    "a store of 4,096 blocks": lambda: pack([1.0, [stored(
        block_hashes=list(range(1, 4097)), token_ids=list(range(16 * 4096)))]]),
    "deep nesting": lambda: b"\x91" * 5000 + b"\xc0",
    "a 4 MiB string": lambda: pack([1.0, [stored(medium="G" * (4 << 20))]]),
    "an ext type": lambda: b"\x92\xcb" + b"\x00" * 8 + b"\xd4\x01\x00",
}


def _deliver(s: StreamSequencer, seq: int, body: bytes, now: float) -> list[Any]:
    return s.live([b"kv", pack_seq(seq), body], now)


@pytest.mark.parametrize("impl", ["compiled", "reference"])
@pytest.mark.parametrize("body", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_event_stream_probe(body: Callable[[], bytes], impl: str) -> None:
    index = PrefixIndex(16) if impl == "compiled" else radix.PrefixIndex(16)
    s = StreamSequencer(replay=True, probe_interval=None)
    s.begin(0.0)
    out = _deliver(s, 0, payload(0), 0.0) + _deliver(s, 1, body(), 0.1)
    out += _deliver(s, 2, payload(2), 0.2)  # the stream goes on
    if any(isinstance(a, ReplayRequest) for a in out):  # seq 1 moved nothing: a gap to 2
        out += s.replayed([b"", b"", pack_seq(1), body()], 0.3)  # the publisher's record
        out += s.replayed([b"", b"", REPLAY_END_SEQ, b""], 0.3)
    for a in out:
        if isinstance(a, Delivered):
            index.apply_batch(1, a.batch.events)
    delivered = [a.seq for a in out if isinstance(a, Delivered)]
    malformed = [a for a in out if isinstance(a, MalformedInput)]
    assert delivered[0] == 0 and delivered[-1] == 2, out
    assert (1 in delivered) != bool(malformed), out
    assert s.last_seq == 2
