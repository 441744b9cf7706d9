"""Our publisher's frames equal vLLM 0.33's golden frames, live and replayed."""

from __future__ import annotations

from typing import Any

import pytest
import zmq
import zmq.asyncio

from indexer.decode import decode_batch
from indexer.events import Removed
from indexer.wire import REPLAY_END_SEQ, BlockRemoved, KVEventBatch, pack_seq, unpack_seq
from workers.cache.publisher import EventPublisher, shift_port


def test_golden_live_frames_parse(golden_frames: dict[str, Any]) -> None:
    for i, (topic, seq, payload) in enumerate(golden_frames["live_frames_hex"]):
        assert bytes.fromhex(topic) == b"kv"
        assert unpack_seq(bytes.fromhex(seq)) == i
        batch = decode_batch(bytes.fromhex(payload))
        assert batch.ts == float(i) and batch.events == [Removed([i], "GPU", 0)]


def test_golden_replay_reply_parses(golden_frames: dict[str, Any]) -> None:
    request = [bytes.fromhex(f) for f in golden_frames["replay_request_hex"]]
    assert request == [b"", pack_seq(0)]
    reply = [[bytes.fromhex(f) for f in frames]
             for frames in golden_frames["replay_reply_frames_hex"]]
    # buffer_steps=3: replay from 0 starts at 2, a gap the consumer must notice
    assert [unpack_seq(f[-2]) for f in reply[:-1]] == [2, 3, 4]
    assert reply[-1] == [b"", b"", REPLAY_END_SEQ, b""]


async def test_publisher_reproduces_vllm_frames(golden_frames: dict[str, Any]) -> None:
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", buffer_batches=3)
    await pub.start()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    pub.drop_next(5)  # no live listener needed: every batch is checked through replay
    for i in range(5):
        batch = KVEventBatch(float(i), [BlockRemoved(block_hashes=[i], medium="GPU",
                                                     group_idx=0)], 0)
        await pub.publish(batch)
    await dealer.send_multipart([b"", pack_seq(0)])
    reply = [await dealer.recv_multipart() for _ in range(4)]
    dealer.close(linger=0)
    ctx.term()
    await pub.close()
    assert [[f.hex() for f in frames] for frames in reply] == \
        golden_frames["replay_reply_frames_hex"]
    live = [f[1:] for f in reply[:-1]]
    assert [[f.hex() for f in frames] for frames in live] == golden_frames["live_frames_hex"][2:]


@pytest.mark.parametrize("endpoint, rank, expected", [
    ("tcp://127.0.0.1:5557", 0, "tcp://127.0.0.1:5557"),
    ("tcp://127.0.0.1:5557", 3, "tcp://127.0.0.1:5560"),
    ("tcp://*:5557", 1, "tcp://*:5558"),
    ("ipc:///tmp/kv", 2, "ipc:///tmp/kv-2"),
])
def test_rank_shifts_ports(endpoint: str, rank: int, expected: str) -> None:
    assert shift_port(endpoint, rank) == expected


def test_rank_shift_needs_a_port() -> None:
    with pytest.raises(ValueError, match="no port"):
        shift_port("tcp://127.0.0.1", 1)


async def test_publish_before_start_is_a_clear_error() -> None:
    pub = EventPublisher("tcp://127.0.0.1:*")
    with pytest.raises(RuntimeError, match="not started"):
        await pub.publish(KVEventBatch(0.0, [], 0))
    await pub.close()
