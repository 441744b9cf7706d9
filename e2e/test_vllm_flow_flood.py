"""The flood of ``e2e/test_flow_flood.py`` through a router with flow control's DEFAULT
settings in front of two stock vLLM CPU servers (``--max-num-seqs 8``, told to the router
with the worker key ``max_num_seqs``): every request answered (served, or refused with 429
and a ``Retry-After``), none running into the client's timeout, every high-priority one
served and ahead of the lows in the router's queue."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.stock_vllm import BLOCK_SIZE, MODEL_NAME, VllmServer
from bench.tiny_model import write_tiny_llama
from e2e.harness import Router, running
from e2e.test_flow_flood import check, flood
from e2e.vllm import vllm_python


@pytest.fixture(scope="module")
def vllm_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm-flood")
    model = write_tiny_llama(root / "model")
    servers = [VllmServer(f"vllm-{i}", python, model, root) for i in range(2)]
    with running(servers) as started:
        router = Router("router", [], root, tokenizer=str(model), block_size=BLOCK_SIZE)
        router.env["KVROUTE_WORKERS"] = ";".join(f"{s.worker_spec},max_num_seqs=8"
                                                 for s in servers)
        started.append(router)
        router.start()
        router.wait_ready(2)
        yield router


def test_a_low_priority_flood_on_vllm_is_answered_and_the_urgent_pass_it(
        vllm_router: Router) -> None:
    low, high = asyncio.run(flood(vllm_router.url, MODEL_NAME, lows=30, highs=4,
                                  low_words=60, low_tokens=24))
    check(low, high)
