"""Batcher scenarios with exact block ids, and the simulated executor's tokens and time."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable

import pytest

from workers.cache.block_keys import ImageSpan, Prompt, RequestBlocks, image_digest
from workers.cache.block_pool import BlockCopy, BlocksCommitted, BlocksEvicted
from workers.cache.cache_manager import CacheManager
from workers.engine.batcher import Batcher, EngineRequest, Output
from workers.engine.executor import BlockTransfer, IterationPlan, SimExecutor
from workers.engine.timing import H200_LLAMA_1B

Sampler = Callable[[str, int], int]


def sample(rid: str, index: int) -> int:
    """A stand-in for the model: token ``index`` of request ``rid``."""
    return 1000 * (ord(rid[0]) - ord("a") + 1) + index


def req(rid: str, tokens: list[int], max_tokens: int = 1, **kw: object) -> EngineRequest:
    return EngineRequest(rid, Prompt(tokens), max_tokens, **kw)  # type: ignore[arg-type]


def tokens_of(plan: IterationPlan, sampler: Sampler = sample) -> dict[str, int]:
    """What an executor samples for ``plan``."""
    out = {c.request_id: sampler(c.request_id, c.output_index) for c in plan.prefill if c.samples}
    out.update({d.request_id: sampler(d.request_id, d.output_index) for d in plan.decode})
    return out


def shape(plan: IterationPlan) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    """Prefill chunks as (id, blocks, start, new, samples); decode steps as (id, blocks, ctx)."""
    return (
        [(c.request_id, c.block_ids, c.start, c.num_new_tokens, c.samples) for c in plan.prefill],
        [(d.request_id, d.block_ids, d.context_len) for d in plan.decode],
    )


def step(b: Batcher, sampler: Sampler = sample) -> tuple[IterationPlan, list[Output]]:
    plan = b.schedule()
    assert plan is not None
    return plan, b.complete(plan, tokens_of(plan, sampler))


def run(b: Batcher, max_iterations: int = 10_000) -> dict[str, list[Output]]:
    """Iterate until every request is done; a deadlock fails on the iteration bound."""
    outputs: dict[str, list[Output]] = {}
    for _ in range(max_iterations):
        plan = b.schedule()
        if plan is None:
            return outputs
        for o in b.complete(plan, tokens_of(plan)):
            outputs.setdefault(o.request_id, []).append(o)
    raise AssertionError(f"not done after {max_iterations} iterations")


def keys(tokens: list[int], block_size: int = 4) -> list[bytes]:
    blocks = RequestBlocks(Prompt(tokens), block_size)
    return [blocks.block(i).key for i in range(blocks.num_full_blocks)]


def stored_keys(cache: CacheManager) -> list[list[bytes]]:
    events = cache.take_events()
    return [[kb.key for kb in e.blocks] for e in events if isinstance(e, BlocksCommitted)]


A = list(range(10, 20))  # 10 tokens: blocks [10..13][14..17] and a partial [18 19]
B = list(range(30, 40))
C = list(range(50, 60))


def test_admission_is_limited_by_blocks() -> None:
    cache = CacheManager(num_blocks=6, block_size=4)
    b = Batcher(cache)
    for rid, tokens in (("a", A), ("b", B), ("c", C)):
        b.add(req(rid, tokens, max_tokens=2))

    # a and b take 3 blocks each; c needs 3 more and waits.
    plan = b.schedule()
    assert plan is not None
    assert shape(plan) == ([("a", (0, 1, 2), 0, 10, True), ("b", (3, 4, 5), 0, 10, True)], [])
    assert plan.admitted == ("a", "b") and plan.transfers == ()
    assert (b.running, b.waiting, b.pending_prefill_tokens) == (2, 1, 30)
    assert b.num_cached_tokens("a") == 0 and b.num_cached_tokens("c") is None
    assert b.complete(plan, {"a": 7, "b": 8}) == [Output("a", 7, 0), Output("b", 8, 0)]
    assert (b.pending_prefill_tokens, b.decode_blocks) == (10, 6)

    # Both decode (their 11th position still fits in block 2 / 5); c still cannot fit.
    plan, outs = step(b)
    assert shape(plan) == ([], [("a", (0, 1, 2), 11), ("b", (3, 4, 5), 11)])
    assert [(o.request_id, o.index, o.finished, o.finish_reason) for o in outs] == [
        ("a", 1, True, "length"),
        ("b", 1, True, "length"),
    ]

    # a freed block 2 (partial: free) then 1 and 0 (committed: evictable); b likewise.
    # c takes the free blocks 2 and 5 first, then evicts a's tail block 1.
    cache.take_events()
    plan, _ = step(b)
    assert shape(plan) == ([("c", (2, 5, 1), 0, 10, True)], [])
    assert cache.take_events()[0] == BlocksEvicted("GPU", [keys(A)[1]])


def test_chunked_prefill_respects_the_token_budget() -> None:
    cache = CacheManager(num_blocks=16, block_size=4)
    b = Batcher(cache, max_num_batched_tokens=8)
    a = list(range(100, 120))  # 20 tokens, 5 blocks
    b.add(req("a", a, max_tokens=2))
    b.add(req("b", B[:6], max_tokens=1))

    # Iteration 1: a's first 8 tokens use the whole budget; b is not admitted.
    plan, outs = step(b)
    assert shape(plan) == ([("a", (0, 1, 2, 3, 4), 0, 8, False)], [])
    assert outs == [] and b.waiting == 1 and b.pending_prefill_tokens == 12 + 6
    assert stored_keys(cache) == [keys(a)[:2]]  # committed once computed, not when scheduled

    plan, outs = step(b)
    assert shape(plan) == ([("a", (0, 1, 2, 3, 4), 8, 8, False)], [])
    assert stored_keys(cache) == [keys(a)[2:4]]

    # Iteration 3: a's last 4 tokens end its prompt (it samples); b gets the 4 left over.
    plan, outs = step(b)
    assert shape(plan) == (
        [("a", (0, 1, 2, 3, 4), 16, 4, True), ("b", (5, 6), 0, 4, False)],
        [],
    )
    assert plan.num_tokens == 8 and plan.admitted == ("b",)
    assert outs == [Output("a", 1000, 0)]
    assert stored_keys(cache) == [keys(a)[4:5], keys(B[:6])[:1]]

    # Iteration 4: a decodes first (its 21st position needs block 7), then b finishes.
    plan, outs = step(b)
    assert shape(plan) == ([("b", (5, 6), 4, 2, True)], [("a", (0, 1, 2, 3, 4, 7), 21)])
    assert plan.num_tokens == 3
    assert outs == [Output("b", 2000, 0, True, "length"), Output("a", 1001, 1, True, "length")]
    assert b.schedule() is None and cache.pool.num_held_blocks == 0


def test_prefix_hit_skips_prefill() -> None:
    cache = CacheManager(num_blocks=8, block_size=4)
    b = Batcher(cache)
    b.add(req("a", A))
    step(b)  # a: blocks 0, 1, 2; commits 0 and 1, finishes, frees

    # b shares a's first 8 tokens: blocks 0 and 1 are reused, only 3 tokens are computed.
    b.add(req("b", [*A[:8], 90, 91, 92]))
    plan, _ = step(b)
    assert shape(plan) == ([("b", (0, 1, 3), 8, 3, True)], [])
    assert plan.prefill[0].num_cached_tokens == 8 and plan.num_tokens == 3
    assert cache.stats().hit_tokens == 8

    # The same prompt again: hits stop one token short, so the last block is recomputed.
    b.add(req("c", A, max_tokens=2))
    again = b.schedule()
    assert again is not None
    assert shape(again) == ([("c", (0, 1, 4), 8, 2, True)], [])
    assert b.num_cached_tokens("c") == 8


def test_preemption_recomputes_the_youngest_request() -> None:
    cache = CacheManager(num_blocks=4, block_size=4)
    b = Batcher(cache)
    pa, pb = [1, 2, 3, 4], [5, 6, 7, 8]
    b.add(req("a", pa, max_tokens=6))
    b.add(req("b", pb, max_tokens=6))

    # Iterations 1-5: both prefill (blocks 0 and 1), then decode; their 5th position takes
    # blocks 2 and 3. The cache is now full.
    for _ in range(5):
        plan, _ = step(b)
    assert shape(plan) == ([], [("a", (0, 2), 8), ("b", (1, 3), 8)])

    # Iteration 6: a's 9th position needs a block and none is free. b, the youngest, is
    # preempted: its uncommitted block 3 goes to a. b waits at the front, nothing is admitted.
    plan, outs = step(b)
    assert shape(plan) == ([], [("a", (0, 2, 3), 9)])
    assert outs == [Output("a", 1005, 5, True, "length")]
    assert (b.preemptions, b.running, b.waiting) == (1, 0, 1)
    assert b.pending_prefill_tokens == 9  # b's prompt plus its 5 tokens, to recompute

    # Iteration 7: b recomputes prompt + 5 outputs (9 positions). Its prompt block 1 is still
    # cached: 4 tokens hit. It takes the free block 3 and evicts a's block 2, then samples its
    # 6th token, not a repeat of an earlier one.
    plan, outs = step(b)
    assert shape(plan) == ([("b", (1, 3, 2), 4, 5, True)], [])
    assert plan.prefill[0].token_ids == (6, 7, 8, 2000, 2001, 2002, 2003, 2004)[3:]
    assert plan.prefill[0].prompt == Prompt(pb) and plan.prefill[0].output_index == 5
    assert outs == [Output("b", 2005, 5, True, "length")]
    assert cache.pool.num_held_blocks == 0


def test_block_pressure_never_deadlocks() -> None:
    # 12 requests whose outputs need three times the cache: preemption must keep them moving.
    cache = CacheManager(num_blocks=8, block_size=4)
    b = Batcher(cache, max_num_batched_tokens=16)
    letters = "abcdefghijkl"
    for i, rid in enumerate(letters):
        b.add(req(rid, [200 + i] * (3 + i % 5), max_tokens=8 + i % 7))
    outputs = run(b)
    assert b.preemptions > 0
    for i, rid in enumerate(letters):
        n = 8 + i % 7
        assert [o.token_id for o in outputs[rid]] == [sample(rid, k) for k in range(n)]
        assert [o.index for o in outputs[rid]] == list(range(n))
        assert [o.finished for o in outputs[rid]] == [False] * (n - 1) + [True]
    assert (b.running, b.waiting, cache.pool.num_held_blocks) == (0, 0, 0)
    assert b.stats().finished == 12


def test_abort_frees_blocks_anywhere() -> None:
    cache = CacheManager(num_blocks=6, block_size=4)
    b = Batcher(cache)
    for rid, tokens in (("a", A), ("b", B), ("c", C)):
        b.add(req(rid, tokens, max_tokens=3))
    step(b)  # a and b run, c waits

    b.abort("c")  # waiting: just forgotten
    b.abort("a")  # running: blocks 0, 1, 2 released
    assert (b.running, b.waiting, cache.pool.num_held_blocks) == (1, 0, 3)
    assert "a" not in b and b.stats().aborted == 2

    # Aborted while its iteration is in flight: the plan completes without it.
    plan = b.schedule()
    assert plan is not None and [d.request_id for d in plan.decode] == ["b"]
    b.abort("b")
    assert b.complete(plan, {}) == [] and cache.pool.num_held_blocks == 0
    with pytest.raises(ValueError, match="unknown request 'b'"):
        b.abort("b")


def test_stop_token_and_ignore_eos() -> None:
    cache = CacheManager(num_blocks=8, block_size=4)
    b = Batcher(cache)
    b.add(req("a", A, max_tokens=5, eos_token_id=2))
    b.add(req("b", B, max_tokens=2, eos_token_id=2, ignore_eos=True))
    plan = b.schedule()
    assert plan is not None
    assert b.complete(plan, {"a": 2, "b": 2}) == [
        Output("a", 2, 0, True, "stop"),
        Output("b", 2, 0),
    ]
    assert cache.pool.num_held_blocks == 3  # only b's


def test_max_num_seqs_limits_admission() -> None:
    b = Batcher(CacheManager(num_blocks=8, block_size=4), max_num_seqs=1)
    b.add(req("a", A, max_tokens=2))
    b.add(req("b", B))
    plan, _ = step(b)
    assert plan.admitted == ("a",) and b.waiting == 1
    plan, _ = step(b)  # a decodes and finishes: b still waits for the next iteration
    assert plan.admitted == ()
    plan, _ = step(b)
    assert plan.admitted == ("b",)


def test_caller_mistakes_are_refused_before_any_change() -> None:
    cache = CacheManager(num_blocks=4, block_size=4)
    b = Batcher(cache, max_model_len=12)
    with pytest.raises(
        ValueError,
        match=r"maximum context length is 12 tokens.*13 tokens "
        r"\(10 in the prompt, 3 in the completion\)",
    ):
        b.add(req("a", A, max_tokens=3))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        req("a", A, max_tokens=0)
    with pytest.raises(ValueError, match="at least one token"):
        req("a", [])
    b.add(req("a", A, max_tokens=2))
    with pytest.raises(ValueError, match="already queued"):
        b.add(req("a", B))

    # A request the whole cache could not hold would block the queue forever.
    small = Batcher(CacheManager(num_blocks=2, block_size=4), max_model_len=100)
    with pytest.raises(ValueError, match="needs up to 3 KV cache blocks"):
        small.add(req("x", A, max_tokens=1))

    plan = b.schedule()
    assert plan is not None
    with pytest.raises(ValueError, match="still in flight"):
        b.schedule()
    with pytest.raises(ValueError, match="no valid sampled token for request 'a'"):
        b.complete(plan, {"a": -1})
    assert b.in_flight is plan  # nothing changed: the plan can still complete
    assert b.complete(plan, {"a": 5}) == [Output("a", 5, 0)]
    with pytest.raises(ValueError, match="not the plan in flight"):
        b.complete(plan, {"a": 5})


def test_host_tier_copies_are_in_the_plan() -> None:
    cache = CacheManager(num_blocks=3, block_size=4, host_blocks=4)
    b = Batcher(cache)
    b.add(req("a", [1, 2, 3, 4, 5]))
    step(b)  # a commits block 0 and finishes: block 0 is evictable
    b.add(req("b", list(range(60, 69))))
    plan, _ = step(b)  # b needs all 3 blocks: block 0 is offloaded to host block 0
    assert plan.transfers == (BlockTransfer((BlockCopy(0, 0),), ()),)

    # a's prompt again: its block is on the host. c's allocation evicts b's block 1 to host
    # block 1 first, then copies host block 0 back into device block 0.
    b.add(req("c", [1, 2, 3, 4, 5]))
    plan, _ = step(b)
    assert shape(plan) == ([("c", (0, 1), 4, 1, True)], [])
    assert plan.transfers == (BlockTransfer((BlockCopy(1, 1),), (BlockCopy(0, 0),)),)
    assert plan.prefill[0].onboard == (BlockCopy(0, 0),)
    assert plan.onboard == (BlockCopy(0, 0),) and plan.offload == (BlockCopy(1, 1),)

    sim = SimExecutor(H200_LLAMA_1B, block_size=4)
    expected = H200_LLAMA_1B.prefill_ms(1, 4) + H200_LLAMA_1B.onboard_ms(1, 4)
    assert sim.modeled_seconds(plan) == pytest.approx(expected / 1e3)


# -- the simulated executor ----------------------------------------------------------------


def mixed_plan() -> IterationPlan:
    b = Batcher(CacheManager(num_blocks=64, block_size=4))
    b.add(req("a", A, max_tokens=4))
    step(b)
    b.add(req("b", list(range(200))))
    plan = b.schedule()
    assert plan is not None
    assert shape(plan)[1] == [("a", (0, 1, 2), 11)]
    return plan


async def test_sim_tokens_are_deterministic_in_the_prompt() -> None:
    plan = mixed_plan()
    one = SimExecutor(speedup=1e9)
    two = SimExecutor(speedup=1e9, block_size=16)
    sampled, _ = await one.execute(plan)
    assert sampled == (await two.execute(plan))[0]
    assert sampled == {"b": one.token(Prompt(list(range(200))), 0), "a": one.token(Prompt(A), 1)}
    assert all(t in one.vocab for t in sampled.values())

    # The same prompt gives the same sequence in any executor; another prompt another one.
    run_a = [one.token(Prompt(A), i) for i in range(16)]
    assert run_a == [two.token(Prompt(A), i) for i in range(16)]
    assert run_a != [one.token(Prompt(B), i) for i in range(16)]
    assert len(set(run_a)) > 1
    # Images enter by digest: the same placeholder tokens with another image differ.
    tokens = [7] * 8
    with_x = Prompt(tokens, [ImageSpan(0, 4, image_digest(b"x", None), None)])
    with_y = Prompt(tokens, [ImageSpan(0, 4, image_digest(b"y", None), None)])
    assert [one.token(with_x, i) for i in range(8)] != [one.token(with_y, i) for i in range(8)]
    # Pinned: the same in every process and release (workers must agree with each other).
    assert run_a[:4] == [67, 45, 110, 64]
    assert SimExecutor(vocab=range(5, 6)).token(Prompt(A), 3) == 5


async def test_the_sim_holds_no_prompt_once_its_request_is_gone() -> None:
    # The seed cache outlives requests (4,096 entries); holding their prompts grew a worker
    # by 65 KiB per request of 8,000 tokens.
    sim = SimExecutor(speedup=1e12)
    plan = mixed_plan()
    sampled, _ = await sim.execute(plan)
    prompts = [weakref.ref(c.prompt) for c in plan.prefill]
    prompts += [weakref.ref(d.prompt) for d in plan.decode]
    assert len(prompts) == 2
    del plan
    gc.collect()  # whatever else held the plan's requests
    assert [p() for p in prompts] == [None, None]
    again, _ = await sim.execute(mixed_plan())  # same request ids, new prompts: same tokens
    assert again == sampled


async def test_sim_time_is_the_model_over_the_speedup() -> None:
    plan = mixed_plan()
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    sim = SimExecutor(H200_LLAMA_1B, speedup=1000.0, block_size=4, sleep=sleep)
    modeled = sim.modeled_seconds(plan)
    assert modeled == pytest.approx(H200_LLAMA_1B.iteration_ms([(200, 0)], [11]) / 1e3)
    _, seconds = await sim.execute(plan)
    assert seconds == pytest.approx(modeled / 1000.0)
    assert slept == [seconds]  # the pass waits out its modeled time

    # A huge speedup does not sleep, but still yields to the loop.
    fast = SimExecutor(speedup=1e12, sleep=sleep)
    _, seconds = await fast.execute(plan)
    assert 0 < seconds < 1e-6 and slept[-1] == 0
    other_ran = asyncio.Event()
    asyncio.get_running_loop().call_soon(other_ran.set)
    await SimExecutor(speedup=1e12).execute(plan)  # the real sleep(0): the loop runs others
    assert other_ran.is_set()

    with pytest.raises(ValueError, match="speedup must be positive"):
        SimExecutor(speedup=0)
    with pytest.raises(ValueError, match="non-empty range"):
        SimExecutor(vocab=range(3, 3))


def test_short_prefills_go_ahead_of_a_long_one() -> None:
    # A long prompt takes the whole budget each iteration first come, first served; with
    # short_prefill a short one that arrives behind it is admitted in the next iteration (the
    # long one leaves a quarter of the budget to admission) and its first token comes out
    # there, the long one finishing an iteration later.
    long, short = list(range(100, 228)), list(range(300, 306))
    for short_prefill, first_token in ((0, {"a": 3, "b": 4}), (8, {"a": 4, "b": 1})):
        b = Batcher(CacheManager(num_blocks=64, block_size=4), max_num_batched_tokens=32,
                    short_prefill=short_prefill)
        b.add(req("a", long))
        step(b)
        b.add(req("b", short))
        firsts = {}
        for i in range(1, 8):
            plan = b.schedule()
            if plan is None:
                break
            assert plan.num_tokens <= 32
            firsts.update((o.request_id, i) for o in b.complete(plan, tokens_of(plan)))
        assert firsts == first_token


def test_shortest_left_goes_first_and_caps_the_longer_chunks() -> None:
    b = Batcher(CacheManager(num_blocks=64, block_size=4), max_num_batched_tokens=32,
                short_prefill=16, short_pass_tokens=8)
    b.add(req("a", list(range(100, 164))))  # 64 tokens
    b.add(req("b", list(range(300, 340))))  # 40 tokens
    plan, _ = step(b)
    assert [(c.request_id, c.num_new_tokens) for c in plan.prefill] == [("a", 32)]
    plan, _ = step(b)
    # "a" (32 left) is long and "b" waits: "a" takes at most short_pass_tokens
    assert [(c.request_id, c.num_new_tokens) for c in plan.prefill] == [("a", 8), ("b", 24)]
    plan, _ = step(b)
    # "b" (16 left) is short and ends its prompt first; "a" (24 left) is capped again
    assert [(c.request_id, c.num_new_tokens, c.samples) for c in plan.prefill] == [
        ("b", 16, True), ("a", 8, False)]
    plan, _ = step(b)
    assert [(c.request_id, c.num_new_tokens, c.samples) for c in plan.prefill] == [
        ("a", 16, True)]


@pytest.mark.parametrize("short_prefill, short_pass", [(0, 0), (8, 0), (8, 8), (24, 4)])
def test_every_order_finishes_every_request_under_block_pressure(
        short_prefill: int, short_pass: int) -> None:
    cache = CacheManager(num_blocks=24, block_size=4)
    b = Batcher(cache, max_num_batched_tokens=16, short_prefill=short_prefill,
                short_pass_tokens=short_pass)
    letters = "abcdefghijklmnop"
    for i, rid in enumerate(letters):
        b.add(req(rid, [200 + i] * (3 + (i * 7) % 40), max_tokens=4 + i % 5))
    outputs = run(b)
    for i, rid in enumerate(letters):
        assert [o.token_id for o in outputs[rid]] == [sample(rid, k) for k in range(4 + i % 5)]
    assert (b.running, b.waiting, cache.pool.num_held_blocks) == (0, 0, 0)


def test_negative_short_prefill_is_refused() -> None:
    with pytest.raises(ValueError, match="short_prefill"):
        Batcher(CacheManager(num_blocks=8, block_size=4), short_prefill=-1)


def test_worker_settings_carry_the_prefill_order_and_refuse_negatives() -> None:
    from workers.settings import WorkerSettingsError, load_worker_settings

    s = load_worker_settings({"short_prefill": 2048}, {"KVROUTE_WORKER_SHORT_PASS_TOKENS": "4096"})
    assert (s.short_prefill, s.short_pass_tokens) == (2048, 4096)
    assert load_worker_settings({}, {}).short_prefill == 0  # first come, first served
    with pytest.raises(WorkerSettingsError, match="short_prefill"):
        load_worker_settings({"short_prefill": -1}, {})


def test_a_request_continuing_a_running_prefill_waits_for_its_prefix() -> None:
    # "b" extends "a"'s prompt: admitted early it would recompute what "a" is about to cache,
    # so the long "a" keeps the whole budget and "b" then finds all of "a" cached.
    a = list(range(100, 164))
    b = Batcher(CacheManager(num_blocks=64, block_size=4), max_num_batched_tokens=32,
                short_prefill=8)
    b.add(req("a", a))
    step(b)
    b.add(req("b", a + list(range(300, 308))))
    plan, _ = step(b)
    assert [(c.request_id, c.num_new_tokens) for c in plan.prefill] == [("a", 32)]
    plan = b.schedule()
    assert plan is not None
    assert [(c.request_id, c.start, c.num_new_tokens) for c in plan.prefill] == [("b", 64, 8)]
    assert b.num_cached_tokens("b") == 64


def test_a_long_waiting_request_that_would_evict_cached_prefixes_waits() -> None:
    # The cache holds a finished request's blocks (evictable) and no empty one: a long waiting
    # request is not admitted early, so the running long prefill keeps the whole budget.
    cache = CacheManager(num_blocks=24, block_size=4)
    b = Batcher(cache, max_num_batched_tokens=32, short_prefill=8)
    b.add(req("z", list(range(500, 592))))  # 92 tokens: 23 blocks, cached once it finishes
    run(b)
    b.add(req("a", list(range(100, 164))))
    step(b)
    assert cache.pool.num_empty_blocks == 0
    b.add(req("l", list(range(300, 316))))  # 16 tokens: longer than short_prefill
    plan, _ = step(b)
    assert [(c.request_id, c.num_new_tokens) for c in plan.prefill] == [("a", 32)]
