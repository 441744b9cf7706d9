"""The worker's side of vLLM's kv_transfer_params: what a request asks, each malformed form
refused with a 400 naming the field, the params a prefill answer carries, and the lease under
which a prefill's blocks are held for its decode worker."""

from __future__ import annotations

from typing import Any

import pytest

from openai_request.bodies import ApiError
from workers.cache.block_keys import Prompt
from workers.http.kv_transfer import (
    MAX_REMOTE_BLOCKS,
    HeldPrefills,
    Transfer,
    answer_params,
    parse_transfer,
)
from workers.runtime import WorkerRuntime
from workers.settings import WorkerSettings


def test_a_request_asks_for_a_remote_decode_or_brings_a_remote_prefill() -> None:
    assert parse_transfer({"prompt": "x"}) is None
    vllm_prefill = {"do_remote_decode": True, "do_remote_prefill": False,
                    "remote_engine_id": None, "remote_block_ids": None,
                    "remote_host": None, "remote_port": None}
    assert parse_transfer({"kv_transfer_params": vllm_prefill}) == Transfer(remote_decode=True)
    decode = {"do_remote_prefill": True, "remote_block_ids": [0, 1, 2]}
    assert parse_transfer({"kv_transfer_params": decode}) == Transfer(remote_blocks=3)


@pytest.mark.parametrize(("params", "reason"), [
    ("yes", "must be an object"),
    ({"do_remote_decode": "yes"}, "do_remote_decode must be true or false"),
    ({"do_remote_prefill": 1}, "do_remote_prefill must be true or false"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "both"),
    ({"do_remote_prefill": True}, "remote_block_ids must be a list"),
    ({"do_remote_prefill": True, "remote_block_ids": [0] * (MAX_REMOTE_BLOCKS + 1)},
     "at most"),
])
def test_malformed_params_are_refused_naming_the_field(params: Any, reason: str) -> None:
    with pytest.raises(ApiError, match=reason) as caught:
        parse_transfer({"kv_transfer_params": params})
    assert caught.value.status == 400


def test_a_prefill_answer_names_this_worker_and_its_full_blocks() -> None:
    settings = WorkerSettings(host="127.0.0.1", port=8123, block_size=32)
    params = answer_params(settings, "inst-1", 100)  # 3 full blocks; the 4th is partial
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": "inst-1", "remote_block_ids": [0, 1, 2],
                      "remote_host": "127.0.0.1", "remote_port": 8123, "tp_size": 1}
    assert parse_transfer({"kv_transfer_params": params}) == Transfer(remote_blocks=3)


def test_params_that_name_a_lease_say_where_to_release_it() -> None:
    settings = WorkerSettings(host="127.0.0.1", port=8123, block_size=32)
    params = answer_params(settings, "inst-1", 100, "lease-7")
    assert params["remote_request_id"] == "lease-7"
    assert parse_transfer({"kv_transfer_params": params}) == Transfer(
        remote_blocks=3, release_url="http://127.0.0.1:8123/kv_transfer/release",
        blocks_url="http://127.0.0.1:8123/kv_transfer/blocks/lease-7",
        remote_request_id="lease-7")


def test_a_held_prefill_is_not_evictable_until_its_decode_takes_it_or_its_lease_ends() -> None:
    runtime = WorkerRuntime(WorkerSettings(block_size=4, num_blocks=64, events_port=None,
                                           replay_port=None))
    engine = runtime.engine
    pool = engine.cache.pool
    prompt = Prompt(tuple(range(10, 27)))  # 4 full blocks, the last one partial
    engine.cache.allocate("prefill", prompt)
    engine.cache.commit_computed("prefill", 16)
    block_ids = engine.cache.block_ids("prefill")[:4]
    engine.cache.free("prefill")  # the prefill ended: its blocks cached and evictable
    assert all(pool.is_evictable(b) for b in block_ids)

    now = [100.0]
    held = HeldPrefills(30.0, clock=lambda: now[0])
    taken, forgotten = held.hold(engine, prompt), held.hold(engine, prompt)
    assert taken is not None and forgotten is not None and len(held) == 2
    assert not any(pool.is_evictable(b) for b in block_ids)
    # The decode worker took the first; the second is held until its lease ends.
    assert held.release(taken) and not held.release(taken)
    now[0] = 129.9
    assert held.expire() == 0 and not any(pool.is_evictable(b) for b in block_ids)
    now[0] = 130.0
    assert held.expire() == 1 and len(held) == 0
    assert all(pool.is_evictable(b) for b in block_ids)
    assert not held.release(forgotten)  # a release after the lease ended finds nothing
