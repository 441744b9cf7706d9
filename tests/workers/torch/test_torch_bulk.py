"""A long chunk's attention split into a bulk and a tail (:mod:`workers.torch.bulk`).

On the CPU the split and the merge run with attention written out in float64 and are compared
with bottom-right causal attention over the whole context; the shapes a worker builds are
checked to cover every chunk its settings allow. On a GPU (marked ``gpu``) the split runs
through cuDNN and flash and is compared with flash alone, and a whole pass's logits with and
without the split.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from openai_request.tokenizer import ByteTokenizer
from tests.support.lazy import LazyModule, require
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.engine.executor import IterationPlan, PrefillChunk
from workers.settings import WorkerSettings

require("torch")
# Imported by the first test that reads them: collecting this module imports no torch.
torch = LazyModule("torch")
bulk = LazyModule("workers.torch.bulk")
model = LazyModule("workers.torch.model")
torch_engine = LazyModule("workers.torch.engine")


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, H, S, D] attention in float64, query heads sharing KV heads, causal from the bottom
    right: the output and the natural log-sum-exp of the scaled scores."""
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1)
    values = v.double().repeat_interleave(group, dim=1)
    scores = q.double() @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n, ctx = q.shape[2], k.shape[2]
        seen = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ values, lse


def _whole(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    out, _ = _explicit(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                       values.transpose(0, 1)[None], causal=True)
    return out[0].transpose(0, 1)


def _pieces(seed: int, new: int, context: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(new, 8, 16, generator=g, dtype=torch.float64)
    keys = torch.randn(context, 2, 16, generator=g, dtype=torch.float64) * 2
    values = torch.randn(context, 2, 16, generator=g, dtype=torch.float64)
    return q, keys, values


@pytest.mark.parametrize(("new", "context", "cut"),
                         [(37, 200, 64), (512, 700, 96), (5, 5 + 32, 32), (70, 170, 100)])
def test_the_bulk_and_the_tail_merge_into_causal_attention_over_the_whole_context(
        new: int, context: int, cut: int) -> None:
    q, keys, values = _pieces(new, new, context)
    out = bulk.split_attention(
        q, keys, values, cut,
        bulk_attention=lambda q, k, v: _explicit(q, k, v, causal=False),
        tail_attention=lambda q, k, v: _explicit(q, k, v, causal=True))
    ref = _whole(q, keys, values)
    assert out.shape == ref.shape
    assert ((out - ref).norm() / ref.norm()).item() < 1e-10


def test_the_bulk_sees_one_shape_and_stride_set_per_padded_size_whatever_the_context() -> None:
    seen = set()

    def bulk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        seen.add((q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride()))
        return _explicit(q, k, v, causal=False)

    for new, context in ((40, 300), (500, 900), (513 - 1, 4000)):
        q, keys, values = _pieces(1, new, context)
        bulk.split_attention(q, keys, values, 128, bulk_attention=bulk_attention,
                             tail_attention=lambda q, k, v: _explicit(q, k, v, causal=True))
    assert len(seen) == 1, seen  # every chunk padded to 512 query rows over 128 bulk positions
    ((q_shape, _, k_shape, _, _, _),) = seen
    assert q_shape[2] == bulk.QUERY_STEP and k_shape[2] == 128


def test_short_chunks_and_short_prefixes_are_not_split() -> None:
    step, least = bulk.BULK_STEP, bulk.MIN_NEW
    assert bulk.bulk_for(least - 1, 10 * step) == 0
    assert bulk.bulk_for(least, least + step - 1) == 0
    assert bulk.bulk_for(least, least + step) == step
    assert bulk.bulk_for(8192, 8192 + 4 * step + 100) == 4 * step


@pytest.mark.parametrize(("max_new", "max_context"), [(8192, 65536), (2048, 20000), (3000, 9000),
                                                      (1024, 65536)])
def test_the_shapes_built_at_start_cover_every_chunk_the_settings_allow(
        max_new: int, max_context: int) -> None:
    shapes = set(bulk.bulk_shapes(max_new, max_context))
    used = set()
    for new in range(bulk.MIN_NEW, max_new + 1):
        rows = bulk.query_rows(new)
        for cut in range(bulk.BULK_STEP, bulk.bulk_for(new, max_context) + 1, bulk.BULK_STEP):
            used.add((rows, cut))
    assert used == shapes
    assert (not shapes) == (max_new < bulk.MIN_NEW or max_context < bulk.MIN_NEW + bulk.BULK_STEP)


def test_the_cpu_never_splits() -> None:
    assert not bulk.available(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="no CUDA device")
@pytest.mark.parametrize(("new", "cached"), [(2048, 8192 + 32), (3000, 4096), (8192, 16384 + 96)])
def test_on_cuda_the_split_equals_flash_over_the_whole_context(new: int, cached: int) -> None:
    assert bulk.available(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    q = torch.randn(new, 32, 64, **kw)
    keys = torch.randn(new + cached, 8, 64, **kw)
    values = torch.randn(new + cached, 8, 64, **kw)
    cut = bulk.bulk_for(new, new + cached)
    assert cut > 0
    out = bulk.split_attention(q, keys, values, cut)
    ref = model.prefill_attention(q, keys, values)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="no CUDA device")
def test_on_cuda_a_pass_split_or_not_gives_the_dense_forwards_logits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cached, new = 4096 + 64, 2100
    cache = CacheManager(256, 32)
    settings = WorkerSettings(engine="torch", torch_model="llama-1b", device="cuda",
                              block_size=32, max_num_batched_tokens=4096, max_model_len=8192,
                              kv_memory_gb=0.5)
    ex = torch_engine.build_torch_executor(settings, ByteTokenizer(), cache)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(4, 260, (cached + new,), generator=g).tolist()
    blocks = tuple(range(-(-(cached + new) // 32)))
    prompt = Prompt(tuple(tokens))
    fill = PrefillChunk("a", blocks, 0, cached, tuple(tokens[:cached]), (), False, 0, prompt)
    chunk = PrefillChunk("a", blocks, cached, new, tuple(tokens[cached:]), (), True, 0, prompt)
    ex.run(IterationPlan(0, (fill,), (), (), ()))
    with torch.inference_mode():
        dense = ex.model.forward_dense(torch.tensor(tokens, device="cuda"))[-1]
    errors = {}
    for split in (True, False):
        monkeypatch.setattr(model, "SPLIT_CHUNKS", split)
        row = ex.logits(IterationPlan(1, (chunk,), (), (), ()))["a"]
        errors[split] = ((row - dense).norm() / dense.norm()).item()
    # Both within the engine's bf16 tolerance of the dense forward (test_torch_engine's).
    assert max(errors.values()) < 5e-2, errors
