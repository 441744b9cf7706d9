"""The torch worker's memory plan, the batcher's context budget, and recompute after a failed
iteration (an allocation failure injected into the real ``tiny`` engine on the CPU)."""

from __future__ import annotations

from typing import Any

import pytest

from openai_request.tokenizer import ByteTokenizer
from tests.support.lazy import LazyModule, require
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink
from workers.engine.batcher import Batcher, EngineRequest
from workers.engine.loop import Engine, RequestFailed
from workers.settings import WorkerSettings

require("torch")
# Imported by the first test that reads them: collecting this module imports no torch.
torch = LazyModule("torch")
torch_engine = LazyModule("workers.torch.engine")
torch_kv = LazyModule("workers.torch.kv")
torch_memory = LazyModule("workers.torch.memory")

GIB = 2**30
MIB = 2**20


def test_the_kv_cache_gets_what_the_share_leaves_in_whole_blocks() -> None:
    plan = torch_memory.plan_memory(total=100 * GIB, utilization=0.25, weights=3 * GIB,
                                    iteration=2 * GIB, graphs=2 * GIB, context=GIB,
                                    block_bytes=3 * MIB)
    assert plan.budget == 25 * GIB
    assert plan.num_blocks == (25 - 3 - 2 - 2 - 1) * GIB // (3 * MIB)
    assert plan.kv == plan.num_blocks * 3 * MIB
    assert plan.total <= plan.budget < plan.total + 3 * MIB


def test_a_hand_set_kv_cache_that_does_not_fit_beside_the_worst_iteration_is_refused() -> None:
    kw: dict[str, Any] = {"total": 100 * GIB, "utilization": 0.22, "weights": 3 * GIB,
                          "iteration": 3 * GIB, "graphs": 3 * GIB, "context": GIB,
                          "block_bytes": MIB}
    assert torch_memory.plan_memory(kv_bytes=12 * GIB, **kw).kv == 12 * GIB  # 22 GiB: just fits
    with pytest.raises(ValueError, match=r"--kv-memory-gb 13 does not fit.*23\.00 GiB, over "
                                         r"its 22\.00 GiB"):
        torch_memory.plan_memory(kv_bytes=13 * GIB, **kw)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        torch_memory.plan_memory(**(kw | {"utilization": 0.1}))
    with pytest.raises(ValueError, match=r"gpu-memory-utilization must be in \(0, 1\]"):
        torch_memory.plan_memory(**(kw | {"utilization": 1.5}))


def test_the_setting_is_checked_where_it_is_read() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        WorkerSettings(gpu_memory_utilization=0)


def test_the_profiled_iterations_are_the_worst_the_batcher_allows_and_run() -> None:
    s = WorkerSettings(engine="torch", torch_model="tiny", device="cpu", block_size=4,
                       max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512)
    budget = torch_memory.iteration_context(s)
    assert budget == torch_memory.MIN_ITERATION_CONTEXT
    prefill, mixed = torch_memory.worst_case_plans(s, block=0)
    [chunk] = prefill.prefill
    assert (chunk.num_new_tokens, chunk.start + chunk.num_new_tokens) == (64, 512)
    assert len(mixed.decode) == 8 and mixed.num_tokens == 64
    touched = sum(d.context_len for d in mixed.decode) + 512
    assert budget - 8 < touched <= budget or all(d.context_len == 512 for d in mixed.decode)
    # Both run on the real forward over a cache of one block (every table names it).
    from workers.torch.model import CONFIGS, Decoder

    model = Decoder(CONFIGS["tiny"], torch.float32, torch.device("cpu"))
    model.init_random(0)
    c = model.config
    kv = torch_kv.PagedKV(num_layers=c.num_layers, block_size=4, kv_heads=c.num_kv_heads,
                          head_dim=c.head_dim, num_blocks=1, host_blocks=0, dtype=torch.float32,
                          device=torch.device("cpu"))
    seen: list[int] = []

    def run(plan: Any) -> None:
        seen.append(len(torch_engine.TorchExecutor(model, kv).run(plan)[0]))

    assert torch_memory.profile_iteration(run, [prefill, mixed], torch.device("cpu")) == 0
    assert seen == [1, 9]  # one sampled token per chunk and per decode step


def test_the_batcher_keeps_each_iteration_under_its_context_budget() -> None:
    cache = CacheManager(num_blocks=256, block_size=4)
    batcher = Batcher(cache, max_num_batched_tokens=64, max_model_len=200,
                      max_iteration_context=300)
    for i in range(6):
        batcher.add(EngineRequest(f"r{i}", Prompt([10 + i] * 120), 20))
    touched = []
    while (plan := batcher.schedule()) is not None:
        touched.append(sum(c.start + c.num_new_tokens for c in plan.prefill)
                       + sum(d.context_len for d in plan.decode))
        batcher.complete(plan, {r: 7 for r in [c.request_id for c in plan.prefill]
                                + [d.request_id for d in plan.decode]})
    assert max(touched) <= 300
    assert max(touched) > 200  # the budget, not something else, is what binds
    with pytest.raises(ValueError, match="must hold one request"):
        Batcher(cache, max_model_len=200, max_iteration_context=100)


def _tiny(num_blocks: int = 64) -> tuple[CacheManager, torch_engine.TorchExecutor]:
    cache = CacheManager(num_blocks, 4)
    s = WorkerSettings(engine="torch", torch_model="tiny", device="cpu", block_size=4,
                       max_num_batched_tokens=32)
    return cache, torch_engine.build_torch_executor(s, ByteTokenizer(), cache)


def _inject(ex: torch_engine.TorchExecutor, fails: Any) -> list[int]:
    """Make the forward raise CUDA's out-of-memory error when ``fails(batch)``; returns the
    list of failed passes' token counts."""
    forward = ex.model.forward_paged
    failed: list[int] = []

    def forward_paged(batch: Any, *args: Any) -> Any:
        if fails(batch):
            failed.append(len(batch.token_ids))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(batch, *args)

    ex.model.forward_paged = forward_paged  # type: ignore[method-assign]
    return failed


async def _serve(
    ex: torch_engine.TorchExecutor, cache: CacheManager, prompts: dict[str, list[int]]
) -> tuple[dict[str, list[int] | str], dict[str, Any]]:
    engine = Engine(cache, Batcher(cache, max_num_batched_tokens=32), ex, EventSink(), None)
    await engine.start()
    try:
        handles = {rid: engine.submit(EngineRequest(rid, Prompt(p), 6))
                   for rid, p in prompts.items()}
        out: dict[str, list[int] | str] = {}
        for rid, handle in handles.items():
            try:
                out[rid] = [o.token_id async for o in handle]
            except RequestFailed as exc:
                out[rid] = str(exc)
        return out, engine.stats()
    finally:
        await engine.stop()


PROMPTS = {f"r{i}": [4 + (i * 37 + j * 11) % 250 for j in range(9 + 5 * i)] for i in range(4)}


async def test_an_allocation_failure_recomputes_its_requests_in_smaller_iterations() -> None:
    cache, ex = _tiny()
    expected, _ = await _serve(ex, cache, PROMPTS)
    cache, ex = _tiny()
    # Passes of more than 12 tokens run out of memory: the first ones (4 prompts) fail.
    failed = _inject(ex, lambda batch: len(batch.token_ids) > 12)
    got, stats = await _serve(ex, cache, PROMPTS)
    assert got == expected  # every request finishes, with the tokens of an undisturbed run
    assert failed and min(failed) > 12
    assert stats["failed_iterations"] == len(failed) == stats["out_of_memory_passes"]
    assert stats["failure_preemptions"] >= 4
    assert stats["failed_requests"] == 0
    assert cache.pool.num_held_blocks == 0


async def test_only_a_request_that_fails_alone_at_the_smallest_size_fails() -> None:
    cache, ex = _tiny()
    # r2 starts with an id no other prompt holds and nothing samples (the byte tokenizer's
    # vocabulary ends at 260); any pass holding it runs out of memory, however small.
    prompts = PROMPTS | {"r2": [300, *PROMPTS["r2"]]}
    _inject(ex, lambda batch: 300 in batch.token_ids.tolist())
    got, stats = await _serve(ex, cache, prompts)
    assert isinstance(got["r2"], str)
    assert "'r2' failed even alone in an iteration: CUDA out of memory" in got["r2"]
    assert all(isinstance(got[r], list) and len(got[r]) == 6 for r in ("r0", "r1", "r3"))
    assert stats["failed_requests"] == 1
    assert cache.pool.num_held_blocks == 0
