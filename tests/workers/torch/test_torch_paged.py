"""Paged attention (:mod:`workers.torch.paged`) against attention over contiguous K/V.

Each case scatters a few sequences' K/V over shuffled blocks of a pool, then compares
:func:`paged_attention` with SDPA over the same K/V laid out contiguously, in float64 on the
CPU. On the CPU the function gathers; on a GPU (marked ``gpu``) it runs the Triton kernel, in
bf16, at shapes that split the context across programs and at shapes that do not.
"""

from __future__ import annotations

import pytest

from tests.support.lazy import LazyModule, require

require("torch")
# Imported by the first test that reads them: collecting this module imports no torch.
torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
torch_graphs = LazyModule("workers.torch.graphs")
torch_paged = LazyModule("workers.torch.paged")

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
TOLERANCE = {"cpu": 1e-6, "cuda": 2e-2}  # ||paged - reference|| / ||reference||


def _pool(device: str, blocks: int, bs: int, hkv: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    return torch.randn(blocks, 2, bs, hkv, d, generator=g).to(device, dtype)


def _contiguous(kv: torch.Tensor, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.cat([kv[b, 0] for b in table])[:n].double()
    v = torch.cat([kv[b, 1] for b in table])[:n].double()
    return k, v  # [n, Hkv, D]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, Hq, D], the last n of len(k) positions, causal, in float64."""
    n, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    keys = k.repeat_interleave(group, dim=1).transpose(0, 1)
    values = v.repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), keys, values,
                                         attn_mask=mask.to(q.device))
    return out.transpose(0, 1)


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("bs", "hq", "hkv", "d"), [(4, 4, 2, 16), (32, 32, 8, 64)])
def test_decode_over_shuffled_blocks_matches_attention_over_contiguous_kv(
    device: str, bs: int, hq: int, hkv: int, d: int
) -> None:
    # One position; partial last blocks.
    lens = [1, 7, bs * 3 + 1, 40 * bs + 5, 3 * torch_paged.BLOCK_N]
    width = max(-(-n // bs) for n in lens)
    kv = _pool(device, width * len(lens) + 3, bs, hkv, d, seed=1)
    order = torch.randperm(kv.shape[0] - 1, generator=torch.Generator().manual_seed(2))
    tables = [order[i * width:(i + 1) * width].tolist() for i in range(len(lens))]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), hq, d, generator=g).to(device, kv.dtype)
    out = torch_paged.paged_attention(q, kv, torch.tensor(tables, device=device),
                                      torch.tensor(lens, device=device), queries=1,
                                      max_context=width * bs)
    for i, n in enumerate(lens):
        k, v = _contiguous(kv, tables[i], n)
        err = _error(out[i : i + 1], _reference(q[i : i + 1], k, v))
        assert err < TOLERANCE[device], f"sequence {i} ({n} positions): error {err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("new", "cached"), [(1, 9), (5, 33), (17, 120), (64, 2000)])
def test_a_chunk_over_cached_blocks_sees_its_prefix_and_its_own_earlier_tokens(
    device: str, new: int, cached: int
) -> None:
    bs, hq, hkv, d = 4, 8, 2, 16
    ctx = cached + new
    blocks = -(-ctx // bs)
    kv = _pool(device, blocks + 5, bs, hkv, d, seed=4)
    table = torch.randperm(blocks + 5, generator=torch.Generator().manual_seed(5))[:blocks]
    q = torch.randn(new, hq, d, generator=torch.Generator().manual_seed(6)).to(device, kv.dtype)
    out = torch_paged.paged_attention(q, kv, table[None].to(device),
                                      torch.tensor([ctx], device=device), queries=new,
                                      max_context=ctx)
    k, v = _contiguous(kv, table.tolist(), ctx)
    err = _error(out, _reference(q, k, v))
    assert err < TOLERANCE[device], f"{new} over {cached}: error {err:.2e}"


def test_the_kernel_is_used_only_on_cuda_and_splits_only_to_fill_the_device() -> None:
    assert not torch_paged.kernel_available(torch.device("cpu"))
    assert torch_paged.splits_for(1, 8, 50) == 1  # one tile of context: nothing to split
    assert torch_paged.splits_for(8, 8, 8192) == 9  # 64 programs a split, 528 wanted
    assert torch_paged.splits_for(256, 8, 65536) == 1  # 2,048 programs fill the device already


def test_every_eager_decode_batch_uses_a_split_the_decode_graphs_compiled_at_start() -> None:
    # The split is a constant of the compiled kernel: one the graphs did not compile would be
    # compiled in the middle of a mixed pass.
    bs, kv_heads, seqs, model_len = 32, 8, 256, 65536
    graphed = {torch_paged.decode_splits(b, kv_heads, w * bs)
               for b, w in torch_graphs.decode_shapes(seqs, model_len, bs, max_slots=None)}
    eager = {torch_paged.decode_splits(n, kv_heads, width * bs)
             for n in range(1, seqs + 1) for width in range(1, model_len // bs + 1)}
    assert eager <= graphed
    assert len(eager) > 4  # the split still follows the batch
    assert (torch_paged.decode_splits(18, kv_heads, 352 * bs)
            == torch_paged.splits_for(32, kv_heads, 512 * bs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunks_in_place", [False, True])
def test_the_paged_forward_matches_the_dense_forward_over_a_cached_prefix(
    device: str, chunks_in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from openai_request.tokenizer import ByteTokenizer
    from workers.cache.block_keys import Prompt
    from workers.cache.cache_manager import CacheManager
    from workers.engine.batcher import Batcher, EngineRequest
    from workers.settings import WorkerSettings
    from workers.torch import model as model_module
    from workers.torch.engine import build_torch_executor

    monkeypatch.setattr(model_module, "CHUNKS_IN_PLACE", chunks_in_place)
    cache = CacheManager(64, 4)
    ex = build_torch_executor(
        WorkerSettings(engine="torch", torch_model="tiny", device=device, block_size=4,
                       max_num_batched_tokens=16, max_model_len=256, cuda_graphs=False),
        ByteTokenizer(), cache)
    batcher = Batcher(cache, max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(8)
    text = torch.randint(4, 260, (37,), generator=g).tolist()
    rows: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for rid in ("cold", "warm"):  # the second finds 36 positions cached
        batcher.add(EngineRequest(rid, Prompt(text), 4))
        seqs = {rid: list(text)}
        while (plan := batcher.schedule()) is not None:
            logits = ex.logits(plan)
            sampled = {r: int(v[: ex.vocab_limit].argmax()) for r, v in logits.items()}
            for r, v in logits.items():
                rows.setdefault(r, []).append((list(seqs[r]), v))
            for out in batcher.complete(plan, sampled):
                seqs[out.request_id].append(out.token_id)
    assert len(rows["warm"]) == 4
    tolerance = {"cpu": 1e-5, "cuda": 5e-2}[device]
    with torch.inference_mode():
        for seq, row in rows["cold"] + rows["warm"]:
            ref = ex.model.forward_dense(torch.tensor(seq, device=row.device))[-1]
            assert ((row - ref).norm() / ref.norm()).item() < tolerance
