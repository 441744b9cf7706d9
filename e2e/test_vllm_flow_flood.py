"""The flood of ``e2e/test_flow_flood.py`` through a router with flow control's DEFAULT
settings in front of two stock vLLM CPU servers (``--max-num-seqs 8``, told to the router
with the worker key ``max_num_seqs``; the pair shared with ``test_vllm_routing``:
:mod:`e2e.vllm`): every request answered (served, or refused with 429
and a ``Retry-After``), none running into the client's timeout, every high-priority one
served and ahead of the lows in the router's queue."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.stock_vllm import BLOCK_SIZE, MODEL_NAME
from e2e.harness import Router, router_over
from e2e.test_flow_flood import check, flood
from e2e.vllm import VllmPair


@pytest.fixture(scope="module")
def vllm_router(vllm_pair: VllmPair) -> Iterator[Router]:
    shared = vllm_pair.fresh()
    router = Router("router-flood", [], shared.root, tokenizer=str(shared.model),
                    block_size=BLOCK_SIZE)
    router.env["KVROUTE_WORKERS"] = ";".join(f"{s.worker_spec},max_num_seqs=8"
                                             for s in shared.servers)
    with router_over(router, shared.servers, 2):
        yield router


def test_a_low_priority_flood_on_vllm_is_answered_and_the_urgent_pass_it(
        vllm_router: Router) -> None:
    low, high = asyncio.run(flood(vllm_router.url, MODEL_NAME, lows=30, highs=4,
                                  low_words=60, low_tokens=24))
    check(low, high)
