"""``kvroute events tail`` against our publisher prints what was published."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from indexer.wire import BlockRemoved, BlockStored, KVEventBatch
from workers.cache.publisher import EventPublisher

pytestmark = pytest.mark.process  # starts child processes


async def run_tail(*args: str, timeout: float = 20.0) -> tuple[int, list[str], str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "events", "tail", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode().splitlines(), err.decode()


async def test_tail_prints_published_batches_as_json() -> None:
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv")
    await pub.start()
    stored = BlockStored(block_hashes=[2**64 - 1], parent_block_hash=None, token_ids=[1, 2],
                         block_size=2, lora_id=None, medium="GPU", lora_name=None, group_idx=0)
    await pub.publish(KVEventBatch(1.5, [stored], 0))
    await pub.publish(KVEventBatch(2.5, [BlockRemoved(block_hashes=[7], medium="CPU",
                                                      group_idx=0)], 0))
    pub.drop_next(1)
    await pub.publish(KVEventBatch(3.5, [], 0))
    code, lines, err = await run_tail("--connect", pub.endpoint, "--replay", pub.replay_endpoint,
                                      "--from-seq", "0", "--count", "3", "--json",
                                      "--timeout", "15")
    await pub.close()
    assert code == 0, err
    records = [json.loads(line) for line in lines]
    assert records == [
        {"seq": 0, "ts": 1.5, "data_parallel_rank": 0, "replayed": True,
         "events": [{"type": "Stored", "block_hashes": [2**64 - 1], "token_ids": [1, 2],
                     "block_size": 2, "medium": "GPU", "group_idx": 0}]},
        {"seq": 1, "ts": 2.5, "data_parallel_rank": 0, "replayed": True,
         "events": [{"type": "Removed", "block_hashes": [7], "medium": "CPU", "group_idx": 0}]},
        {"seq": 2, "ts": 3.5, "data_parallel_rank": 0, "replayed": True, "events": []},
    ]


async def test_tail_reports_lost_history_readably() -> None:
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_batches=2)
    await pub.start()
    for i in range(4):
        await pub.publish(KVEventBatch(float(i), [], 0))
    code, lines, err = await run_tail("--connect", pub.endpoint, "--replay", pub.replay_endpoint,
                                      "--from-seq", "0", "--count", "2", "--timeout", "15")
    await pub.close()
    assert code == 0, err
    assert lines[0].startswith("!! history_lost first_missing=0 resumed_at=2")
    assert lines[1:] == ["seq=2 ts=2.000 rank=0 (replayed): no events",
                         "seq=3 ts=3.000 rank=0 (replayed): no events"]


async def test_tail_rejects_from_seq_without_replay() -> None:
    code, _, err = await run_tail("--connect", "tcp://127.0.0.1:1", "--from-seq", "0")
    assert code == 2 and "--from-seq needs --replay" in err


async def test_tail_times_out_when_nothing_arrives() -> None:
    pub = EventPublisher("tcp://127.0.0.1:*")
    await pub.start()
    code, lines, err = await run_tail("--connect", pub.endpoint, "--timeout", "0.5")
    await pub.close()
    assert code == 3 and lines == [] and "nothing for 0.5s" in err


async def test_tail_over_curve(tmp_path: Path) -> None:
    from kvroute.keys import generate_keypair
    from workers.cache.publisher import CurveServerKeys

    server_pub, server_secret = generate_keypair(tmp_path / "server", "worker")
    _, client_secret = generate_keypair(tmp_path / "clients", "tail")
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                         curve=CurveServerKeys.load(server_secret, tmp_path / "clients"))
    await pub.start()
    await pub.publish(KVEventBatch(1.5, [], 0))
    code, lines, err = await run_tail("--connect", pub.endpoint, "--replay", pub.replay_endpoint,
                                      "--from-seq", "0", "--count", "1", "--json",
                                      "--timeout", "15", "--curve-secret-key",
                                      str(client_secret), "--curve-server-key", str(server_pub))
    assert code == 0, err
    assert [json.loads(line)["seq"] for line in lines] == [0]
    code, _, err = await run_tail("--connect", pub.endpoint, "--curve-secret-key",
                                  str(tmp_path / "missing"), "--curve-server-key",
                                  str(server_pub))
    assert code == 2 and "CURVE key file" in err
    code, _, err = await run_tail("--connect", pub.endpoint, "--curve-server-key",
                                  str(server_pub))
    await pub.close()
    assert code == 2 and "go together" in err
