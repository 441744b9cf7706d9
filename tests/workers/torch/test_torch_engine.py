"""The torch engine on the ``tiny`` decoder: paged KV against a dense forward from scratch.

Every scenario drives the real Batcher and CacheManager and compares each sampled position's
logits with :meth:`Decoder.forward_dense` over the same tokens (float32 on the CPU; bf16 on a
GPU, marked ``gpu``). Block size 4 keeps prompts short while crossing many blocks.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from openai_request.tokenizer import ByteTokenizer
from tests.support.lazy import LazyModule, require
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink
from workers.engine.batcher import Batcher, EngineRequest
from workers.engine.executor import DecodeStep
from workers.engine.loop import Engine
from workers.settings import WorkerSettings

require("torch")
# Imported by the first test that reads them: collecting this module imports no torch.
torch = LazyModule("torch")
torch_engine = LazyModule("workers.torch.engine")
torch_graphs = LazyModule("workers.torch.graphs")
torch_model = LazyModule("workers.torch.model")
torch_piecewise = LazyModule("workers.torch.piecewise")

BS = 4
POISON = 1e4  # finite: a masked-out position weighs zero, and 0 * 1e4 is still 0

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif("not torch.cuda.is_available()", reason="no CUDA device"),
        ],
    ),
]
# ||paged - dense|| / ||dense||: float32 arithmetic vs bf16 weights and activations.
TOLERANCE = {"cpu": 1e-5, "cuda": 5e-2}


def settings(device: str, **kw: Any) -> WorkerSettings:
    values: dict[str, Any] = {
        "engine": "torch",
        "torch_model": "tiny",
        "device": device,
        "block_size": BS,
        "max_num_batched_tokens": 16,
    }
    return WorkerSettings(**(values | kw))


def executor(
    device: str, num_blocks: int, host_blocks: int = 0, **kw: Any
) -> tuple[CacheManager, torch_engine.TorchExecutor]:
    cache = CacheManager(num_blocks, BS, host_blocks)
    return cache, torch_engine.build_torch_executor(settings(device, **kw), ByteTokenizer(), cache)


class Driver:
    """Runs a batcher over an executor synchronously, keeping every sampled position's logits."""

    def __init__(self, cache: CacheManager, ex: torch_engine.TorchExecutor,
                 budget: int = 16) -> None:
        self.cache, self.ex = cache, ex
        self.batcher = Batcher(cache, max_num_batched_tokens=budget)
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.logits: dict[str, list[Any]] = {}
        self.chunks: list[Any] = []
        self.blocks: set[int] = set()  # every block a plan gave a request

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.prompts[rid] = prompt
        self.batcher.add(EngineRequest(rid, Prompt(prompt), max_tokens))

    def run(self) -> None:
        while (plan := self.batcher.schedule()) is not None:
            self.chunks.extend(plan.prefill)
            for step in (*plan.prefill, *plan.decode):
                self.blocks.update(step.block_ids)
            logits = self.ex.logits(plan)
            sampled = {}
            for rid, row in logits.items():
                self.logits.setdefault(rid, []).append(row)
                sampled[rid] = int(row[: self.ex.vocab_limit].argmax())
            for out in self.batcher.complete(plan, sampled):
                self.tokens.setdefault(out.request_id, []).append(out.token_id)

    def check(self, rid: str, device: str) -> None:
        """Every sampled position of ``rid`` matches the dense forward over its sequence."""
        seq = list(self.prompts[rid])
        assert len(self.logits[rid]) == len(self.tokens[rid])
        with torch.inference_mode():
            for row, token in zip(self.logits[rid], self.tokens[rid], strict=True):
                ref = self.ex.model.forward_dense(torch.tensor(seq, device=row.device))[-1]
                err = ((row - ref).norm() / ref.norm()).item()
                assert err < TOLERANCE[device], f"{rid} position {len(seq)}: error {err:.2e}"
                seq.append(token)

    def start_of(self, rid: str) -> int:
        return next(c.start for c in self.chunks if c.request_id == rid)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(4, 260, (n,), generator=g)).tolist()


def poison_unused(cache: CacheManager, ex: torch_engine.TorchExecutor) -> None:
    """Overwrite every device block that is not a cached block, as if reused by someone."""
    keep = set(cache.pool.evictable_blocks())
    assert cache.pool.num_held_blocks == 0, "poison only between requests"
    for b in range(cache.pool.num_blocks):
        if b not in keep:
            ex.kv.device_blocks[b].fill_(POISON)


@pytest.mark.parametrize("device", DEVICES)
def test_logits_over_a_cached_prefix_equal_logits_from_scratch(device: str) -> None:
    cache, ex = executor(device, num_blocks=64)
    d = Driver(cache, ex)
    shared = prompt(1, 26)
    d.add("a", shared + prompt(2, 4), 3)
    d.run()
    poison_unused(cache, ex)
    # b shares a's first 6 full blocks (24 tokens) and computes only its own tail, in two
    # chunks of the 16-token budget, then decodes over the cached prefix.
    d.add("b", shared + prompt(3, 14), 4)
    d.run()
    assert d.start_of("b") == 24
    assert cache.stats().hit_tokens == 24
    d.check("a", device)
    d.check("b", device)


@pytest.mark.parametrize("device", DEVICES)
def test_offload_and_onboard_round_trip_keeps_logits(device: str) -> None:
    cache, ex = executor(device, num_blocks=12, host_blocks=16)
    d = Driver(cache, ex)
    first = prompt(4, 24)
    d.add("a", first, 1)  # 6 full blocks, all committed when a finishes
    d.run()
    # b needs 10 of the 12 blocks: 6 free, then 4 of a's, tail first (a freed its tail
    # first): a's blocks 2..5 go to the host tier, blocks 0..1 stay on the device.
    d.add("b", prompt(5, 40), 1)
    d.run()
    assert cache.stats().offloads == 4
    poison_unused(cache, ex)  # only a's blocks 0..1 (and b's) survive on the device
    d.add("c", first + prompt(6, 5), 3)
    d.run()
    stats = cache.stats()
    assert stats.onboards == 4
    assert d.start_of("c") == 24
    assert stats.host_hit_tokens == 16
    d.check("b", device)
    d.check("c", device)


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_freed_and_reused_do_not_leak_old_contents(device: str) -> None:
    cache, ex = executor(device, num_blocks=8)
    d = Driver(cache, ex)
    d.add("a", prompt(7, 30), 2)  # fills all 8 blocks, the last one partly
    d.run()
    assert cache.stats().device_evictions == 0
    # b's prompt ends mid-block and it decodes into the rest of that block: every block it
    # gets held a's KV, and the slots past b's context still do.
    d.add("b", prompt(8, 13), 6)
    d.run()
    assert cache.stats().hit_tokens == 0
    d.check("b", device)
    # Two requests at once reuse the same freed blocks in one batch (prefill and decode mixed).
    d.add("c", prompt(9, 9), 5)
    d.add("e", prompt(10, 6), 5)
    d.run()
    d.check("c", device)
    d.check("e", device)


def padded_executor(device: str) -> tuple[CacheManager, torch_engine.TorchExecutor]:
    """An executor with graphs on, every device block poisoned. On CUDA the graphs are
    captured and replayed; on the CPU the same padded forwards run eagerly."""
    cache, plain = executor(device, num_blocks=64)
    ex = torch_engine.TorchExecutor(plain.model, plain.kv, vocab_limit=plain.vocab_limit,
                                    cuda_graphs=True)
    ex.kv.device_blocks[: cache.pool.num_blocks].fill_(POISON)
    return cache, ex


def assert_padding_wrote_no_free_block(cache: CacheManager, ex: torch_engine.TorchExecutor,
                                       d: Driver) -> None:
    """Padding wrote only the scratch block: every block no request was given still holds
    the poison."""
    untouched = [b for b in range(cache.pool.num_blocks) if b not in d.blocks]
    assert untouched, "the test needs free blocks to watch"
    assert bool((ex.kv.device_blocks[untouched] == POISON).all())


@pytest.mark.parametrize("device", DEVICES)
def test_padded_decode_steps_match_the_dense_forward_and_touch_no_free_block(
    device: str,
) -> None:
    cache, ex = padded_executor(device)
    assert ex.graphs is not None
    d = Driver(cache, ex, budget=128)
    # Three requests decode together (a batch of 3 padded to 4) over tables of 2, 10 and 18
    # blocks (padded to 8, 16 and 32 wide as they grow), then one alone.
    for i, n in enumerate((5, 38, 70)):
        d.add(f"r{i}", prompt(20 + i, n), 6)
    d.run()
    d.add("r3", prompt(23, 9), 4)
    d.run()
    assert ex.graphs.steps >= 8
    if device == "cuda":
        assert ex.graphs.replayed == ex.graphs.steps and ex.graphs.captured >= 2
    for rid in ("r0", "r1", "r2", "r3"):
        d.check(rid, device)
    assert_padding_wrote_no_free_block(cache, ex, d)


@pytest.mark.parametrize("device", DEVICES)
def test_padded_prefill_iterations_match_the_dense_forward_and_touch_no_free_block(
    device: str,
) -> None:
    cache, ex = padded_executor(device)
    assert ex.piecewise is not None
    d = Driver(cache, ex, budget=40)
    # Under a 40-token budget: b's 40 tokens from position 0, then b's last 18 over its cached
    # first chunk with c's 20, both padded to the 64 bucket (the second pass's two padded
    # rows held b's tokens in the first: padding must not write them again).
    d.add("b", prompt(32, 58), 5)
    d.add("c", prompt(33, 20), 5)
    d.run()
    # Then a mixed pass: e's last 15 tokens with g's first decode step (16 bucket).
    d.add("g", prompt(34, 5), 6)
    d.add("e", prompt(35, 50), 4)
    d.run()
    assert ex.piecewise.iterations == 4
    if device == "cuda":
        assert ex.piecewise.replayed == ex.piecewise.iterations and ex.piecewise.captured >= 2
    for rid in ("b", "c", "e", "g"):
        d.check(rid, device)
    assert d.start_of("b") == 0 and any(c.start > 0 for c in d.chunks if c.request_id == "b")
    assert_padding_wrote_no_free_block(cache, ex, d)


@pytest.mark.parametrize("device", DEVICES)
def test_a_worker_captures_its_token_buckets_and_decode_shapes_before_serving(
    device: str,
) -> None:
    cache, ex = executor(device, num_blocks=64, max_num_batched_tokens=40, max_num_seqs=4,
                         max_model_len=64)
    if device == "cpu":  # graphs are a CUDA feature: a CPU worker runs every pass unpadded
        assert ex.piecewise is None and ex.graphs is None
        return
    assert ex.piecewise is not None and ex.graphs is not None
    assert ex.piecewise.captured == 3  # 16, 32 and 64 tokens: every bucket 40 tokens can use
    assert ex.graphs.captured == 6  # batches 1, 2, 4 x widths 8, 16 blocks (64 tokens)
    d = Driver(cache, ex, budget=40)
    d.add("a", prompt(40, 50), 3)
    d.add("b", prompt(41, 7), 3)
    d.run()
    assert ex.piecewise.captured == 3 and ex.piecewise.replayed == ex.piecewise.iterations >= 2
    assert ex.graphs.captured == 6 and ex.graphs.replayed == ex.graphs.steps >= 1
    for rid in ("a", "b"):
        d.check(rid, device)


def test_long_passes_use_the_projections_one_by_one_and_agree_with_the_dense_forward() -> None:
    cache, ex = executor("cpu", num_blocks=512)
    d = Driver(cache, ex, budget=torch_model.FUSE_MAX_TOKENS + 100)
    # One pass of 600 tokens (separate projections), then one of 60 new over them (fused).
    shared = prompt(50, torch_model.FUSE_MAX_TOKENS + 88)
    d.add("long", shared, 2)
    d.run()
    d.add("short", shared + prompt(51, 60), 3)
    d.run()
    assert [c.num_new_tokens for c in d.chunks] == [torch_model.FUSE_MAX_TOKENS + 88, 60 + 88 % BS]
    d.check("long", "cpu")
    d.check("short", "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("new, context", [(6, 6), (3, 11), (1, 9)])
def test_chunk_attention_lets_each_query_see_its_prefix_through_grouped_heads(
    device: str, new: int, context: int
) -> None:
    """A chunk's attention (flash on CUDA, SDPA elsewhere) against a float32 reference written
    out: query i of the last ``new`` positions sees the first ``context - new + i + 1``, and
    each group of 4 query heads reads one KV head."""
    g = torch.Generator().manual_seed(new * 100 + context)
    shapes = ((new, 8), (context, 2), (context, 2))
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in shapes)
    visible = torch.arange(context)[None, :] <= (context - new + torch.arange(new))[:, None]
    scores = torch.einsum("nhd,chd->hnc", q, k.repeat_interleave(4, 1)) / 4.0  # sqrt(16)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    want = torch.einsum("hnc,chd->nhd", weights, v.repeat_interleave(4, 1))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    got = torch_model.prefill_attention(*(t.to(device, dtype) for t in (q, k, v))).float().cpu()
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < TOLERANCE[device]


def test_iterations_past_the_largest_token_bucket_run_unpadded() -> None:
    _, plain = executor("cpu", num_blocks=64)
    ex = torch_engine.TorchExecutor(plain.model, plain.kv, vocab_limit=plain.vocab_limit,
                                    cuda_graphs=True)
    assert ex.piecewise is not None
    assert ex.piecewise.fits(1) and ex.piecewise.fits(torch_piecewise.TOKEN_BUCKETS[-1])
    assert not ex.piecewise.fits(torch_piecewise.TOKEN_BUCKETS[-1] + 1) and not ex.piecewise.fits(0)


def test_the_decode_shapes_captured_at_start_cover_every_step_set_the_graphs_take() -> None:
    _, plain = executor("cpu", num_blocks=64)
    ex = torch_engine.TorchExecutor(plain.model, plain.kv, vocab_limit=plain.vocab_limit,
                                    cuda_graphs=True)
    assert ex.graphs is not None
    max_batch, max_context = 40, 3000
    shapes = set(torch_graphs.decode_shapes(max_batch, max_context, BS))
    rng = random.Random(0)
    taken = 0
    for _ in range(300):
        contexts = [rng.randint(1, max_context) for _ in range(rng.randint(1, max_batch))]
        steps = [DecodeStep(f"s{i}", (0,), c, 5, 0, Prompt((5,))) for i, c in enumerate(contexts)]
        if ex.graphs.fits(steps):
            taken += 1
            batch = next(b for b in torch_graphs.BATCH_BUCKETS if b >= len(steps))
            width = max(torch_graphs.MIN_WIDTH, 1 << (-(-max(contexts) // BS) - 1).bit_length())
            assert (batch, width) in shapes
    assert taken == 300
    assert max(b for b, _ in shapes) == 64 and max(w for _, w in shapes) == 1024
    # A long context allows widths whose large batches would gather too much: left out.
    wide = torch_graphs.decode_shapes(256, 65536, BS)
    assert (1, 16384) in wide and (64, 16384) not in wide
    assert all(b * w * BS <= torch_graphs.MAX_SLOTS for b, w in wide)


def test_decode_steps_too_large_to_pad_are_left_to_the_unpadded_forward() -> None:
    _, plain = executor("cpu", num_blocks=64)
    ex = torch_engine.TorchExecutor(plain.model, plain.kv, vocab_limit=plain.vocab_limit,
                                    cuda_graphs=True)
    assert ex.graphs is not None
    step = DecodeStep("x", tuple(range(40)), 40 * BS, 5, 0, Prompt([5] * (40 * BS)))
    assert ex.graphs.fits([step])
    assert not ex.graphs.fits([step] * 300)  # more rows than the largest batch bucket
    wide = DecodeStep("y", (0,), torch_graphs.MAX_SLOTS + 1, 5, 0, Prompt([5]))  # too long to pad
    assert not ex.graphs.fits([wide])


@pytest.mark.parametrize("device", DEVICES)
async def test_engine_produces_deterministic_greedy_tokens_and_reports_cached_tokens(
    device: str,
) -> None:
    cache, ex = executor(device, num_blocks=64)
    batcher = Batcher(cache, max_num_batched_tokens=16)
    engine = Engine(cache, batcher, ex, EventSink(), None)
    await engine.start()
    try:
        text = prompt(11, 30)

        async def ask(rid: str) -> tuple[int, list[int]]:
            handle = engine.submit(EngineRequest(rid, Prompt(text), 8, eos_token_id=None))
            cached = await handle.admitted()
            return cached, [out.token_id async for out in handle]

        cold, first = await ask("r1")
        warm, second = await ask("r2")
    finally:
        await engine.stop()
    assert (cold, warm) == (0, 28)  # 7 full blocks; the last prompt position is recomputed
    assert len(first) == 8
    assert second == first
    if device == "cpu":
        seq = list(text)
        with torch.inference_mode():
            for token in first:
                logits = ex.model.forward_dense(torch.tensor(seq))[-1]
                assert int(logits[: ex.vocab_limit].argmax()) == token
                seq.append(token)
    assert all(0 <= t < ByteTokenizer.vocab_size for t in first)


def test_same_seed_same_weights_and_seed_changes_them() -> None:
    _, one = executor("cpu", num_blocks=4)
    _, two = executor("cpu", num_blocks=4)
    _, other = executor("cpu", num_blocks=4, seed=1)
    w = [
        dict(e.model.named_parameters())["model.layers.1.mlp.up_proj.weight"]
        for e in (one, two, other)
    ]
    assert torch.equal(w[0], w[1])
    assert not torch.equal(w[0], w[2])


def _write_safetensors(path: Path, tensors: dict[str, Any]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, t in tensors.items():
        data = t.detach().contiguous().numpy().tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_loads_a_local_checkpoint_folder(tmp_path: Path, model_type: str) -> None:
    c = replace(torch_model.CONFIGS["tiny"], attention_bias=model_type == "qwen2")
    random = torch_model.Decoder(c, torch.float32, torch.device("cpu"))
    random.init_random(7)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": model_type,
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads,
                "intermediate_size": c.intermediate_size,
                "rms_norm_eps": c.rms_norm_eps,
                "rope_theta": c.rope_theta,
            }
        )
    )
    state = dict(random.named_parameters())
    assert ("model.layers.0.self_attn.q_proj.bias" in state) == (model_type == "qwen2")
    names = sorted(state)
    _write_safetensors(
        tmp_path / "model-00001.safetensors", {n: state[n] for n in names[: len(names) // 2]}
    )
    _write_safetensors(
        tmp_path / "model-00002.safetensors", {n: state[n] for n in names[len(names) // 2 :]}
    )
    cache = CacheManager(16, BS)
    loaded = torch_engine.build_torch_executor(
        settings("cpu", torch_model=str(tmp_path)), ByteTokenizer(), cache
    )
    tokens = torch.tensor(prompt(12, 9))
    with torch.inference_mode():
        assert torch.equal(loaded.model.forward_dense(tokens), random.forward_dense(tokens))
    # The paged forward's fused q/k/v and gate/up weights are the loaded ones too.
    d = Driver(cache, loaded)
    d.add("l", prompt(13, 9), 3)
    d.run()
    d.check("l", "cpu")


def test_kv_memory_budget_sizes_the_cache() -> None:
    # tiny: 2 layers x K,V x 4 positions x 2 KV heads x 16 dims x 4 bytes = 2 KiB a block.
    assert torch_engine.kv_blocks_for(settings("cpu", kv_memory_gb=1 / 1024)) == 512


def test_running_out_of_cuda_memory_while_capturing_says_what_to_lower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, plain = executor("cpu", num_blocks=64)
    ex = torch_engine.TorchExecutor(plain.model, plain.kv, vocab_limit=plain.vocab_limit,
                                    cuda_graphs=True)
    assert ex.graphs is not None

    def out_of_memory(*_: object) -> int:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    torch_engine.capture_at_start(ex, settings("cpu"))  # nothing to capture without CUDA: no error
    monkeypatch.setattr(ex.graphs, "capture_shapes", out_of_memory)
    with pytest.raises(torch_engine.TorchEngineError,
                       match=r"KV cache: lower --kv-memory-gb.*--no-cuda-graphs"):
        torch_engine.capture_at_start(ex, settings("cpu"))


def test_clear_errors_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(torch_engine.TorchEngineError, match="neither a configuration"):
        torch_engine.kv_blocks_for(settings("cpu", torch_model="no-such-model"))
    with pytest.raises(torch_engine.TorchEngineError, match="holds no"):
        torch_engine.kv_blocks_for(settings("cpu", kv_memory_gb=1e-9))
    monkeypatch.setitem(sys.modules, "torch", None)  # as if PyTorch were not installed
    with pytest.raises(torch_engine.TorchEngineError, match=r"pip install 'kvroute\[torch\]'"):
        torch_engine.kv_blocks_for(settings("cpu"))
