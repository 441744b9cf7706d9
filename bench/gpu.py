"""The torch engine on a real device: prefill, cached prefill, decode, and routing over engines.

Run: ``python -m bench.gpu [--json] [--model llama-1b] [--device auto]``.

Sections (``docs/gpu.md`` holds the figures and what they mean):

- ``ttft``: one 8,192-token prompt computed cold; the same prompt with 8,128 tokens cached (its
  first 254 blocks already in the request's block table) and 64 new; 64 new tokens alone; the
  cached pass mixed with 32 decode steps over 1,024-token contexts. Each is one executor pass,
  sampling included, median of ``--repeats``; eager and (on CUDA) padded
  into per-layer piecewise graphs (:mod:`workers.torch.piecewise`), in one run; and the first
  piecewise pass of three token buckets (64, 128, 2,048), which captures that bucket's graphs.
- ``attention``: one layer's attention for one prefill chunk of n new tokens over c cached,
  as :meth:`Decoder.attend` runs it between the piecewise graphs (K/V read in place through
  the block table) and with the blocks gathered first (ms, median of ``--repeats``, host time
  per call included): 64 over 8,128, 2,048 over 8,192 and 30,720, 8,192 over 8,192 and
  24,576.
- ``paged_decode``: decode attention at batch 8 and 32 over 8k and 32k contexts, through the
  paged kernel, flex attention and the gather, in ns per token of context against the floor
  (one read of each token's K/V at the copy bandwidth measured in the same run); and the
  whole decode step the worker runs at those shapes.
- ``decode_context``: decode attention of all layers by batch and context, gathered (the
  blocks gathered, then masked attention: what runs without the paged kernel), over K/V
  already contiguous (what a paged kernel can reach) and, on CUDA,
  through a paged kernel (flex attention over 32-token pages), and each one's cost per token
  of context: what the simulated engine's decode cost stands for.
- ``prefill_context``: prefill attention of all layers for n new tokens over c cached, K/V
  contiguous (flash attention, bottom-right causal, query heads sharing KV heads: what a kernel
  reading paged K/V in place can reach), by (n, c); and the least-squares cost of a cached
  token and of a new x cached token pair (the extra time over the same n with nothing cached):
  what the simulated engine's ``prefill_per_cached_ms`` and ``prefill_per_token_cached_ms``
  stand for, set beside the calibration's fit.
- ``decode``: tokens/s of decode iterations at batch 1, 8 and 32 over 1,024-token prompts,
  eager and (on CUDA) replayed as CUDA graphs (:mod:`workers.torch.graphs`), in one run.
- ``routing`` (the first attempt, kept for comparison; ``bench.gpu_routing`` is the routing
  benchmark: one worker process per engine behind the real router): ``--workers`` engines (own cache
  manager, batcher and KV blocks, one shared set of weights, one GPU) driven in this process from
  the shared Mooncake synthetic trace, each hash id scaled to 64 tokens (512 / 8) and outputs to
  1/8. Two policies place the requests: round-robin, and kvroute's (the real
  :class:`~indexer.index.PrefixIndex` fed by each engine's published event batches through the wire
  codec, predicted residency, and :func:`router.routing.scheduler.choose` over each engine's
  reported load). Arrivals keep the trace's spacing, compressed so the prompt tokens arrive at
  ``--load`` times the device's measured cold prefill rate. Reported: TTFT p50/p99 and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from bench.workloads import DEFAULT_TRACE
from indexer.decode import decode_batch
from indexer.index import PrefixIndex, block_hashes, scope_seed
from indexer.wire import KVEventBatch, encode_batch
from openai_request.tokenizer import ByteTokenizer
from router.routing.residency import PredictedResidency
from router.routing.scheduler import Candidate, SchedulerConfig, choose
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink
from workers.cache.publisher import EventPublisher
from workers.engine.batcher import Batcher, EngineRequest
from workers.engine.executor import DecodeStep, IterationPlan, PrefillChunk
from workers.engine.loop import Engine, RequestHandle
from workers.settings import WorkerSettings
from workers.torch.engine import TorchExecutor, build_torch_executor
from workers.torch.kv import PagedKV

BS = 32
TOKENS_PER_HASH = 64  # the trace's 512-token blocks, scaled by 1/8


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _chunk(rid: str, blocks: Sequence[int], tokens: Sequence[int], start: int) -> PrefillChunk:
    return PrefillChunk(
        rid,
        tuple(blocks),
        start,
        len(tokens) - start,
        tuple(tokens[start:]),
        (),
        True,
        0,
        Prompt(tuple(tokens)),
    )


def _plan(prefill: Sequence[PrefillChunk] = (), decode: Sequence[DecodeStep] = ()) -> IterationPlan:
    return IterationPlan(0, tuple(prefill), tuple(decode), (), ())


def _executor(args: argparse.Namespace, cache: CacheManager) -> TorchExecutor:
    s = WorkerSettings(
        engine="torch", torch_model=args.model, device=args.device, block_size=BS, seed=0
    )
    return build_torch_executor(s, ByteTokenizer(), cache)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 260) for _ in range(n)]


def bench_ttft(args: argparse.Namespace, ex: TorchExecutor, cache: CacheManager) -> dict[str, Any]:
    """Passes with prefill (ms): cold 8k, 64 new over 8,128 cached, 64 new alone, and that
    cached pass mixed with 32 decode steps over 1,024-token contexts; each eager and (when the
    executor has them) padded into piecewise graphs, side by side in this one run."""
    rng = random.Random(1)
    n, cached = 8192, 8128
    long = _tokens(rng, n)
    a = cache.allocate("ttft-long", Prompt(long))
    short = _tokens(rng, n - cached)
    b = cache.allocate("ttft-short", Prompt(short))
    assert a is not None and b is not None, "the cache is too small for the ttft bench"
    steps = []
    for i in range(32):
        ctx = _tokens(rng, 1024)
        alloc = cache.allocate(f"ttft-dec-{i}", Prompt(ctx))
        assert alloc is not None, "the cache is too small for the ttft bench"
        steps.append(DecodeStep(f"dec-{i}", tuple(alloc.block_ids), 1024, ctx[-1], 0,
                                Prompt(tuple(ctx))))
    cold = _plan([_chunk("cold", a.block_ids, long, 0)])
    warm = _plan([_chunk("warm", a.block_ids, long, cached)])
    alone = _plan([_chunk("alone", b.block_ids, short, 0)])
    mixed = _plan([_chunk("warm", a.block_ids, long, cached)], steps)
    piecewise = ex.piecewise
    out: dict[str, Any] = {}
    if piecewise is not None:
        # First use of a bucket captures its graphs: what the first such pass costs, once.
        first = _plan([_chunk("first", a.block_ids, long[:2000], 0)])
        for name, plan in (("new_64", alone), ("cached_64_with_32_decodes", mixed),
                           ("new_2000", first)):
            _sync()
            t = time.perf_counter()
            ex.run(plan)
            _sync()
            out[f"{name}_first_use_ms_piecewise"] = (time.perf_counter() - t) * 1e3
    for mode in ("eager", "piecewise") if piecewise is not None else ("eager",):
        ex.piecewise = piecewise if mode == "piecewise" else None
        suffix = "" if mode == "eager" else "_piecewise"
        out |= {
            f"cold_8192_ms{suffix}": _median_ms(lambda: ex.run(cold), args.repeats),
            f"cached_8128_new_64_ms{suffix}": _median_ms(lambda: ex.run(warm), args.repeats),
            f"new_64_alone_ms{suffix}": _median_ms(lambda: ex.run(alone), args.repeats),
            f"cached_64_with_32_decodes_ms{suffix}": _median_ms(
                lambda: ex.run(mixed), args.repeats
            ),
        }
    ex.piecewise = piecewise
    if args.profile:
        _profile(ex, {"cold 8192": cold, "cached 8128 + 64": warm})
    for rid in ("ttft-long", "ttft-short", *(f"ttft-dec-{i}" for i in range(32))):
        cache.free(rid)
    out["cached_over_alone"] = out["cached_8128_new_64_ms"] / out["new_64_alone_ms"]
    if "new_64_alone_ms_piecewise" in out:
        out["cached_over_alone_piecewise"] = (
            out["cached_8128_new_64_ms_piecewise"] / out["new_64_alone_ms_piecewise"]
        )
    out["cold_tokens_per_s"] = n / out["cold_8192_ms"] * 1e3
    return out


#: (new, cached) tokens of the attention section's chunks.
ATTENTION_SHAPES = ((64, 8128), (2048, 8192), (2048, 30720), (8192, 8192), (8192, 24576))


def bench_attention(args: argparse.Namespace, ex: TorchExecutor) -> list[dict[str, Any]]:
    """One layer's chunk attention by shape (ms): ``paged``, as :meth:`Decoder.attend` runs
    it (:func:`workers.torch.paged.paged_attention`: K/V read in place through the table), and
    ``gathered``, the blocks gathered first and flash attention run over them."""
    import torch

    from workers.torch import paged
    from workers.torch.model import PagedBatch, _prefill_attention, prefill_views

    c, kv = ex.model.config, ex.kv.layers()[0]
    gen = torch.Generator(device="cpu").manual_seed(3)
    out = []
    for new, cached in ATTENTION_SHAPES:
        blocks = -(-(new + cached) // BS)
        if blocks > ex.kv.num_blocks:
            continue
        table = torch.randperm(ex.kv.num_blocks, generator=gen)[:blocks].to(kv.device)
        batch = PagedBatch(token_ids=torch.empty(0), positions=torch.empty(0),
                           slot_rows=torch.empty(0), prefill=((0, cached, new, table),),
                           decode_offset=new, decode_tables=None, decode_lens=None,
                           logit_rows=torch.empty(0))
        views = prefill_views(batch)
        q = torch.randn(new, c.num_heads, c.head_dim, generator=gen).to(kv)
        k = torch.empty(new, c.num_kv_heads, c.head_dim).to(kv)  # unread: K/V come from blocks
        attention = torch.empty_like(q)

        def attend() -> None:
            ex.model.attend(attention, q, k, k, kv, views, batch)  # noqa: B023

        def gathered() -> None:
            keys = kv[:, 0].index_select(0, table).flatten(0, 1)[: new + cached]  # noqa: B023
            values = kv[:, 1].index_select(0, table).flatten(0, 1)[: new + cached]  # noqa: B023
            attention.copy_(_prefill_attention(q, keys, values))  # noqa: B023

        row = {"new": new, "cached": cached, "ms": _median_ms(attend, args.repeats),
               "gathered_ms": _median_ms(gathered, args.repeats)}
        if kv.device.type == "cuda":  # the kernel's launch for a chunk, by variant
            default = paged.PREFILL_CONFIG
            for config in PREFILL_VARIANTS:
                paged.PREFILL_CONFIG = config
                row["paged_{}_{}_{}_ms".format(*config)] = _median_ms(attend, args.repeats)
            paged.PREFILL_CONFIG = default
        out.append(row)
    return out


#: (query tokens, warps, stages) of the chunk kernel the attention section times.
PREFILL_VARIANTS = ((16, 4, 2), (32, 4, 2), (32, 4, 3), (32, 8, 3), (16, 4, 3))


#: (batch, context) shapes of the paged-decode section.
PAGED_DECODE_SHAPES = ((8, 8192), (8, 32768), (32, 8192), (32, 32768))


def copy_bandwidth(device: Any, gib: int = 4) -> float:
    """Bytes/s of a device-to-device copy of ``gib`` GiB, bytes read plus written."""
    import torch

    src = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), 10)
    return 2 * (gib << 30) / (ms / 1e3)


def bench_paged_decode(args: argparse.Namespace, ex: TorchExecutor) -> dict[str, Any]:
    """Decode at batch 8 and 32 over 8k and 32k contexts (CUDA): the attention of every
    layer three ways (the paged kernel, flex attention's paged decoding, the gather), each
    in ns per token of context beside the floor (each token's K/V read once, at the copy
    bandwidth measured here); and the whole decode step as the worker runs it (a replayed
    CUDA graph), ms. Random block tables over a pool larger than twice the K/V read."""
    import torch

    from workers.torch.paged import paged_attention

    c, device = ex.model.config, ex.kv.device
    dtype = ex.kv.layers()[0].dtype
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype.itemsize
    bandwidth = copy_bandwidth(device)
    torch.manual_seed(9)
    rows = []
    for batch, context in PAGED_DECODE_SHAPES:
        width = -(-context // BS)
        pool = max(4096, 2 * batch * width)
        kv = torch.randn(pool, 2, BS, c.num_kv_heads, c.head_dim, device=device, dtype=dtype)
        tables = torch.randint(0, pool, (batch, width), device=device)
        lens = torch.full((batch,), context, dtype=torch.long, device=device)
        q = torch.randn(batch, c.num_heads, c.head_dim, device=device, dtype=dtype)
        tokens = batch * context
        floor_ms = tokens * per_token / bandwidth * 1e3

        def attend(kernel: bool) -> None:
            for _ in range(c.num_layers):
                paged_attention(q, kv, tables, lens, queries=1,  # noqa: B023
                                max_context=width * BS, use_kernel=kernel)  # noqa: B023

        row: dict[str, Any] = {"batch": batch, "context": context, "floor_ms": floor_ms,
                               "kernel_eager_ms": _median_ms(lambda: attend(True), args.repeats),
                               "kernel_ms": _median_ms(_graphed(lambda: attend(True)),
                                                       args.repeats)}
        try:
            row["gathered_ms"] = _median_ms(lambda: attend(False), args.repeats)
        except torch.cuda.OutOfMemoryError:
            row["gathered_ms"] = None
        torch.cuda.empty_cache()
        try:
            row["flex_ms"] = _paged_attention_ms(args, ex, batch, context)
        except Exception as exc:  # a compile failure is a finding, not a stop
            row["flex_error"] = repr(exc)[:200]
        torch.cuda.empty_cache()
        for key in ("kernel_ms", "kernel_eager_ms", "gathered_ms", "flex_ms"):
            if row.get(key) is not None:
                row[key.replace("_ms", "_ns_per_token")] = row[key] * 1e6 / tokens
        row["floor_ns_per_token"] = floor_ms * 1e6 / tokens
        row["kernel_over_floor"] = row["kernel_ms"] / floor_ms
        row["step_ms"] = _decode_step_ms(args, ex, batch, context)
        rows.append(row)
    return {"bandwidth_gb_s": bandwidth / 1e9, "bytes_per_token": per_token, "shapes": rows}


def _graphed(fn: Any) -> Any:
    """``fn`` captured as a CUDA graph (after two warm-up calls); returns its replay: device
    time without the host's launches, as the worker's decode graphs run attention."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _decode_step_ms(args: argparse.Namespace, ex: TorchExecutor, batch: int,
                    context: int) -> float:
    """One whole decode iteration of ``batch`` requests over ``context`` tokens each, their
    tables drawn at random from the executor's cache (ms, median)."""
    rng = random.Random(batch * context)
    width = -(-context // BS)
    blocks = ex.kv.num_blocks
    steps = [DecodeStep(f"s{i}", tuple(rng.randrange(blocks) for _ in range(width)), context,
                        5, 0, Prompt((5,))) for i in range(batch)]
    plan = _plan((), steps)
    return _median_ms(lambda: ex.run(plan), args.repeats)


#: (batch, context) shapes of the decode-context section.
DECODE_CONTEXT_SHAPES = ((8, 4096), (32, 4096), (64, 4096), (64, 8192), (128, 4096),
                         (128, 8192), (256, 4096))


def bench_decode_context(args: argparse.Namespace, ex: TorchExecutor) -> dict[str, Any]:
    """Decode attention of every layer by (batch, context), two ways (ms, median of
    ``--repeats``, host time included): ``gathered``, each step's blocks gathered from a random
    block table, then masked attention (what runs without the paged kernel), and
    ``in_place``, attention over K/V already contiguous per sequence (flash attention, query
    heads folded by KV head as the engine folds them), the best a kernel that reads paged K/V
    in place can do; and on CUDA ``paged``, a real paged kernel (:func:`_paged_attention_ms`).
    Also the least-squares cost per token of context (ns, all layers): the
    figure a simulated engine's ``decode_per_context_ms`` stands for. Shapes the device has
    no memory for are left out."""
    import torch

    torch.manual_seed(5)  # values drawn on the device: a CPU draw of 16 GB takes a minute
    rows, skipped = [], []
    for batch, context in DECODE_CONTEXT_SHAPES:
        try:
            row = _decode_attention_ms(args, ex, batch, context)
            if ex.kv.device.type == "cuda":
                row["paged_ms"] = _paged_attention_ms(args, ex, batch, context)
            rows.append(row)
        except torch.cuda.OutOfMemoryError:
            skipped.append([batch, context])
        if ex.kv.device.type == "cuda":
            torch.cuda.empty_cache()
    paged = [r for r in rows if "paged_ms" in r]
    return {"layers": ex.model.config.num_layers, "shapes": rows, "out_of_memory": skipped,
            "gathered_ns_per_token": per_token_ns(rows, "gathered_ms"),
            "in_place_ns_per_token": per_token_ns(rows, "in_place_ms"),
            "paged_ns_per_token": per_token_ns(paged, "paged_ms")}


#: (new, cached) shapes of the prefill-context section; each n also runs with nothing cached.
PREFILL_CONTEXT_SHAPES = ((64, 0), (64, 2048), (64, 8192), (64, 32768), (512, 0), (512, 2048),
                          (512, 8192), (512, 32768), (2048, 0), (2048, 8192), (2048, 32768))


def bench_prefill_context(args: argparse.Namespace, ex: TorchExecutor) -> dict[str, Any]:
    """Prefill attention of every layer by (new, cached), K/V contiguous per layer (ms, median
    of ``--repeats``, host time included), as :func:`workers.torch.model._prefill_attention`
    computes a chunk; then :func:`cached_costs` of the rows, beside the calibration's fit
    (:data:`workers.engine.timing.H200_LLAMA_1B`). Shapes the device has no memory for are left
    out."""
    import torch

    from workers.engine.timing import H200_LLAMA_1B

    torch.manual_seed(7)
    rows, skipped = [], []
    for new, cached in PREFILL_CONTEXT_SHAPES:
        try:
            rows.append({"new": new, "cached": cached,
                         "ms": _prefill_context_ms(args, ex, new, cached)})
        except torch.cuda.OutOfMemoryError:
            skipped.append([new, cached])
        if ex.kv.device.type == "cuda":
            torch.cuda.empty_cache()
    fit = cached_costs(rows)
    return {"layers": ex.model.config.num_layers, "shapes": rows, "out_of_memory": skipped,
            "per_cached_ms": fit and fit[0], "per_token_cached_ms": fit and fit[1],
            "calibration_per_cached_ms": H200_LLAMA_1B.prefill_per_cached_ms,
            "calibration_per_token_cached_ms": H200_LLAMA_1B.prefill_per_token_cached_ms}


def _prefill_context_ms(args: argparse.Namespace, ex: TorchExecutor, new: int,
                        cached: int) -> float:
    import torch

    from workers.torch.model import _prefill_attention

    c = ex.model.config
    on = {"device": ex.kv.device, "dtype": ex.kv.layers()[0].dtype}
    q = torch.randn(new, c.num_heads, c.head_dim, **on)
    # One K/V per layer, so that no layer reads what another left in the L2.
    keys = [torch.randn(cached + new, c.num_kv_heads, c.head_dim, **on)
            for _ in range(c.num_layers)]
    values = [torch.randn_like(k) for k in keys]

    def attend() -> None:
        for k, v in zip(keys, values, strict=True):
            _prefill_attention(q, k, v)

    return _median_ms(attend, args.repeats)


def cached_costs(rows: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """Least squares of the time a cache adds, ``ms(n, c) - ms(n, 0) = a * c + b * n * c``,
    over the rows with c > 0 whose n also ran with nothing cached: ``(a, b)`` in ms per cached
    token and per new x cached token pair; None with fewer than two such rows."""
    import numpy as np

    alone = {r["new"]: r["ms"] for r in rows if r["cached"] == 0}
    extra = [(r["cached"], r["new"] * r["cached"], r["ms"] - alone[r["new"]])
             for r in rows if r["cached"] > 0 and r["new"] in alone]
    if len(extra) < 2:
        return None
    x = np.array([[c, nc] for c, nc, _ in extra], dtype=float)
    (a, b), *_ = np.linalg.lstsq(x, np.array([e for *_, e in extra], dtype=float), rcond=None)
    return float(a), float(b)


def _decode_attention_ms(args: argparse.Namespace, ex: TorchExecutor, batch: int,
                         context: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from workers.torch.paged import paged_attention

    c, device = ex.model.config, ex.kv.device
    on = {"device": device, "dtype": ex.kv.layers()[0].dtype}
    hkv, group, d = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
    width = -(-context // BS)
    pool = max(4096, 2 * batch * width)  # blocks the tables draw from: more than the L2 holds
    kv = torch.randn(pool, 2, BS, hkv, d, **on)
    tables = torch.randint(0, pool, (batch, width), device=device)
    lens = torch.full((batch,), width * BS, device=device)
    q = torch.randn(batch, c.num_heads, d, **on)
    # One contiguous K/V per layer, so that no layer reads what another left in the L2.
    keys = torch.randn(c.num_layers, batch, hkv, context, d, **on)
    values = torch.randn_like(keys)
    folded = q.view(batch, hkv, group, d)

    def gathered() -> None:  # the blocks gathered, then masked SDPA (no paged kernel)
        for _ in range(c.num_layers):
            paged_attention(q, kv, tables, lens, queries=1, max_context=width * BS,
                            use_kernel=False)

    def in_place() -> None:
        for layer in range(c.num_layers):
            F.scaled_dot_product_attention(folded, keys[layer], values[layer])

    return {"batch": batch, "context": context,
            "gathered_ms": _median_ms(gathered, args.repeats),
            "in_place_ms": _median_ms(in_place, args.repeats)}


def _paged_attention_ms(args: argparse.Namespace, ex: TorchExecutor, batch: int,
                        context: int) -> float:
    """Decode attention of every layer through a kernel that reads paged K/V in place: flex
    attention (compiled to its decoding kernel) over a pool of ``BS``-token pages, each step's
    pages named by a random page table (CUDA only; ms, median of ``--repeats``)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    c, device = ex.model.config, ex.kv.device
    on = {"device": device, "dtype": ex.kv.layers()[0].dtype}
    pages = -(-context // BS)
    pool = batch * pages + 64
    keys = [torch.randn(1, c.num_kv_heads, pool * BS, c.head_dim, **on)
            for _ in range(c.num_layers)]
    values = [torch.randn_like(keys[0]) for _ in range(c.num_layers)]
    table = torch.randperm(pool, device=device)[: batch * pages].view(batch, pages)
    # kv_indices must span the pool's pages (the first kv_num_blocks of each row count).
    indices = torch.zeros(batch, 1, 1, pool, dtype=torch.int32, device=device)
    indices[:, 0, 0, :pages] = table
    mask = BlockMask.from_kv_blocks(
        torch.full((batch, 1, 1), pages, dtype=torch.int32, device=device), indices,
        BLOCK_SIZE=(128, BS), seq_lengths=(1, pool * BS), compute_q_blocks=False)
    q = torch.randn(batch, c.num_heads, 1, c.head_dim, **on)
    attend = torch.compile(flex_attention, dynamic=False)

    def paged() -> None:
        for layer in range(c.num_layers):
            attend(q, keys[layer], values[layer], block_mask=mask, enable_gqa=True)

    return _median_ms(paged, args.repeats)


def per_token_ns(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """Slope of ``key`` (ms) over batch x context (tokens), least squares, in ns per token;
    None with fewer than two distinct sizes."""
    import numpy as np

    x = np.array([r["batch"] * r["context"] for r in rows], dtype=float)
    if len(set(x)) < 2:
        return None
    slope, _ = np.polyfit(x, np.array([r[key] for r in rows], dtype=float), 1)
    return float(slope * 1e6)


def _profile(ex: TorchExecutor, plans: dict[str, IterationPlan]) -> None:
    """Print the device and host time of each pass's top operators."""
    from torch.profiler import ProfilerActivity, profile

    for name, plan in plans.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ex.run(plan)
        print(f"# profile {name}", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12), flush=True)


def bench_decode(
    args: argparse.Namespace, ex: TorchExecutor, cache: CacheManager, batch: int
) -> dict[str, Any]:
    """Median decode iteration at ``batch`` requests of 1,024-token prompts."""
    rng = random.Random(batch)
    b = Batcher(cache, max_num_batched_tokens=8192, max_num_seqs=batch)
    steps = args.decode_steps
    for i in range(batch):
        b.add(
            EngineRequest(
                f"dec-{batch}-{i}", Prompt(_tokens(rng, 1024)), steps + 4, ignore_eos=True
            )
        )
    times = []
    while (plan := b.schedule()) is not None:
        sampled, seconds = ex.run(plan)
        if not plan.prefill and len(plan.decode) == batch:
            times.append(seconds)
            last = plan
        b.complete(plan, sampled)
    if args.profile and batch == 8:
        _profile(ex, {"decode batch 8": last})
    ms = statistics.median(times[2:]) * 1e3
    return {"batch": batch, "ctx": 1024, "step_ms": ms, "tokens_per_s": batch / ms * 1e3}


# -- routing ---------------------------------------------------------------------------------


class IndexFeed:
    """Stands in for a worker's publisher: each batch goes through the wire codec into the
    router's index, as a ZMQ subscriber would apply it (minus the socket)."""

    def __init__(self, index: Any, worker: int) -> None:
        self.index, self.worker = index, worker
        self.next_seq = 0

    async def publish(self, batch: KVEventBatch) -> int:
        self.index.apply_batch(self.worker, decode_batch(encode_batch(batch)).events)
        self.next_seq += 1
        return self.next_seq - 1


def load_trace(path: Path, first: int, count: int) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[first : first + count]


_HASH_TOKENS: dict[int, list[int]] = {}


def trace_prompt(row: dict[str, Any]) -> list[int]:
    """The row's prompt: each hash id's 64 deterministic tokens, cut to input_length / 8."""
    tokens: list[int] = []
    for h in row["hash_ids"]:
        block = _HASH_TOKENS.get(h)
        if block is None:
            block = _HASH_TOKENS[h] = _tokens(random.Random(h), TOKENS_PER_HASH)
        tokens.extend(block)
    n = max(1, -(-row["input_length"] // (512 // TOKENS_PER_HASH)))
    return tokens[:n]


async def replay(
    args: argparse.Namespace, policy: str, rows: list[dict[str, Any]], span_s: float, model: Any
) -> dict[str, Any]:
    """Replay ``rows`` over ``--workers`` engines placed by ``policy``; TTFT and throughput."""
    index = PrefixIndex(BS)
    engines: list[Engine] = []
    for w in range(args.workers):
        cache = CacheManager(args.worker_blocks, BS)
        kv = PagedKV(
            num_layers=model.config.num_layers,
            block_size=BS,
            kv_heads=model.config.num_kv_heads,
            head_dim=model.config.head_dim,
            num_blocks=args.worker_blocks,
            host_blocks=0,
            dtype=model.dtype,
            device=model.device,
        )
        ex = TorchExecutor(model, kv, vocab_limit=ByteTokenizer.vocab_size)
        batcher = Batcher(cache, max_num_batched_tokens=8192)
        engines.append(
            Engine(
                cache, batcher, ex, EventSink(), cast(EventPublisher, IndexFeed(index, w)), rank=w
            )
        )
    for e in engines:
        await e.start()
    predicted = PredictedResidency(ttl=2.0)
    config, rng = SchedulerConfig(), random.Random(0)
    seed = scope_seed(None, None)
    t0 = rows[0]["timestamp"]
    last = rows[-1]["timestamp"] - t0 or 1
    ttft: list[float] = []
    tokens_out = 0
    start = time.perf_counter()

    async def consume(handle: RequestHandle, arrived: float) -> None:
        nonlocal tokens_out
        async for out in handle:
            if out.first:
                ttft.append(time.perf_counter() - arrived)
            tokens_out += 1

    tasks = []
    for i, row in enumerate(rows):
        due = start + (row["timestamp"] - t0) / last * span_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        prompt = trace_prompt(row)
        if policy == "round_robin":
            worker = i % args.workers
        else:
            now = time.perf_counter()
            hashes = block_hashes(prompt, BS, seed=seed)
            matches = index.match(hashes)
            candidates = []
            for w, e in enumerate(engines):
                matched, device = matches.get(w, (0, 0))
                extended = predicted.extend(w, hashes, matched, now)
                load = e.load()
                candidates.append(
                    Candidate(
                        w,
                        extended,
                        device + extended - matched,
                        load["pending_prefill_tokens"] / BS,
                        load["decode_blocks"],
                        int(load["running"] + load["waiting"]),
                    )
                )
            worker = choose(len(hashes), candidates, config, rng).worker
            predicted.predict(worker, hashes, now)
        max_tokens = max(1, row["output_length"] // 8)
        handle = engines[worker].submit(
            EngineRequest(f"r{i}", Prompt(prompt), max_tokens, ignore_eos=True)
        )
        tasks.append(asyncio.create_task(consume(handle, time.perf_counter())))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    stats = [e.cache.stats() for e in engines]
    for e in engines:
        await e.stop()
    query = sum(s.query_tokens for s in stats)
    prompt_tokens = sum(len(trace_prompt(r)) for r in rows)
    ttft.sort()
    return {
        "policy": policy,
        "requests": len(rows),
        "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3,
        "ttft_p99_ms": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] * 1e3,
        "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
        "makespan_s": elapsed,
        "requests_per_s": len(rows) / elapsed,
        "tokens_per_s": (prompt_tokens + tokens_out) / elapsed,
        "hit_rate": sum(s.hit_tokens for s in stats) / query if query else 0.0,
        "preemptions": sum(e.batcher.preemptions for e in engines),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", default="llama-1b", help="tiny, llama-1b or a folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument(
        "--cold-rate",
        type=float,
        default=150_000.0,
        help="cold prefill tokens/s to scale loads by when ttft is not run",
    )
    parser.add_argument("--profile", action="store_true", help="print operator profiles")
    parser.add_argument("--sections", default="ttft,decode,routing")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--worker-blocks",
        type=int,
        default=6144,
        help="KV blocks per routed engine (llama-1b: 1 MiB each)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="the Mooncake synthetic trace (default: bench/data)",
    )
    parser.add_argument("--first", type=int, default=3200, help="first trace request")
    parser.add_argument("--count", type=int, default=793, help="trace requests replayed")
    parser.add_argument(
        "--loads", default="1.0,2.0", help="offered prompt tokens / cold prefill rate, one run each"
    )
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    result: dict[str, Any] = {"model": args.model}

    import torch

    cache = CacheManager(2048, BS)
    ex = _executor(args, cache)
    result["device"] = torch.cuda.get_device_name() if ex.kv.device.type == "cuda" else "cpu"
    result["torch"] = torch.__version__
    result["params"] = ex.model.config.num_params
    cold_rate = None
    if "ttft" in sections:
        result["ttft"] = bench_ttft(args, ex, cache)
        cold_rate = result["ttft"]["cold_tokens_per_s"]
        _log(args, "ttft", result["ttft"])
    if "attention" in sections:
        result["attention"] = bench_attention(args, ex)
        _log(args, "attention", result["attention"])
    if "decode_context" in sections:
        result["decode_context"] = bench_decode_context(args, ex)
        _log(args, "decode_context", result["decode_context"])
    if "prefill_context" in sections:
        result["prefill_context"] = bench_prefill_context(args, ex)
        _log(args, "prefill_context", result["prefill_context"])
    if "paged_decode" in sections:
        result["paged_decode"] = bench_paged_decode(args, ex)
        _log(args, "paged_decode", result["paged_decode"])
    if ex.memory is not None:
        m = ex.memory
        result["memory"] = {"budget": m.budget, "weights": m.weights, "iteration": m.iteration,
                            "graphs_allowed": m.graphs, "graphs_measured": ex.graph_bytes,
                            "kv_planned": m.kv, "iteration_context": m.iteration_context,
                            "peak_reserved": torch.cuda.max_memory_reserved()}
    if "decode" in sections:
        # Eager and CUDA-graph decode side by side, in this one run (CUDA only has graphs).
        graphs = ex.graphs
        result["decode"] = []
        for mode in ("eager", "graphs") if graphs is not None else ("eager",):
            ex.graphs = graphs if mode == "graphs" else None
            for b in (1, 8, 32):
                result["decode"].append(bench_decode(args, ex, cache, b) | {"mode": mode})
        ex.graphs = graphs
        _log(args, "decode", result["decode"])
    if "routing" in sections:
        del ex
        gc.collect()
        from workers.torch.engine import resolve_device, resolve_model
        from workers.torch.model import Decoder

        config, _ = resolve_model(args.model)
        device = resolve_device(args.device)
        model = Decoder(config, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
        model.init_random(0)
        rows = load_trace(args.trace or DEFAULT_TRACE, args.first, args.count)
        prompt_tokens = sum(len(trace_prompt(r)) for r in rows)
        rate = cold_rate or args.cold_rate
        result["routing"] = {
            "workers": args.workers,
            "worker_blocks": args.worker_blocks,
            "requests": len(rows),
            "prompt_tokens": prompt_tokens,
            "cold_tokens_per_s": rate,
            "runs": [],
        }
        for load in (float(x) for x in args.loads.split(",")):
            span = prompt_tokens / (load * rate)
            for policy in ("round_robin", "kvroute"):
                run = asyncio.run(replay(args, policy, rows, span, model))
                run.update(load=load, arrival_span_s=span)
                result["routing"]["runs"].append(run)
                _log(args, "routing", run)
                gc.collect()
    print(json.dumps(result, indent=1) if args.json else _table(result))
    return 0


def _log(args: argparse.Namespace, section: str, value: Any) -> None:
    if args.json:
        print(f"# {section}: {json.dumps(value)}", flush=True)


def _table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} on {result['device']} (torch {result['torch']})"]
    t = result.get("ttft")
    if t:
        lines.append(
            f"ttft cold 8192: {t['cold_8192_ms']:.1f} ms; 8128 cached + 64 new: "
            f"{t['cached_8128_new_64_ms']:.1f} ms; 64 alone: {t['new_64_alone_ms']:.1f}"
            f" ms (ratio {t['cached_over_alone']:.2f}); that cached pass with 32 decodes: "
            f"{t['cached_64_with_32_decodes_ms']:.1f} ms"
        )
        if "new_64_alone_ms_piecewise" in t:
            lines.append(
                f"piecewise graphs: cold 8192: {t['cold_8192_ms_piecewise']:.1f} ms; 8128 "
                f"cached + 64 new: {t['cached_8128_new_64_ms_piecewise']:.1f} ms; 64 alone: "
                f"{t['new_64_alone_ms_piecewise']:.1f} ms (ratio "
                f"{t['cached_over_alone_piecewise']:.2f}); with 32 decodes: "
                f"{t['cached_64_with_32_decodes_ms_piecewise']:.1f} ms; first use (capture): "
                f"{t['new_64_first_use_ms_piecewise']:.0f} / "
                f"{t['cached_64_with_32_decodes_first_use_ms_piecewise']:.0f} / "
                f"{t['new_2000_first_use_ms_piecewise']:.0f} ms (buckets 64 / 128 / 2048)"
            )
    for a in result.get("attention", []):
        variants = ", ".join(f"{k[6:-3]} {v:.3f}" for k, v in a.items()
                             if k.startswith("paged_"))
        lines.append(f"attention, one layer: {a['new']} new over {a['cached']} cached: "
                     f"paged {a['ms']:.3f} ms, gathered {a['gathered_ms']:.3f} ms"
                     + (f" (kernel variants q_warps_stages: {variants})" if variants else ""))
    pd = result.get("paged_decode")
    if pd:
        lines.append(f"decode attention, all layers ({pd['bytes_per_token']} bytes of K/V a "
                     f"token, copy bandwidth {pd['bandwidth_gb_s']:.0f} GB/s), ns per token of "
                     f"context:")
        for r in pd["shapes"]:
            lines.append(
                f"  batch {r['batch']} x {r['context']}: kernel {r['kernel_ns_per_token']:.2f} "
                f"({r['kernel_ms']:.3f} ms graphed, {r['kernel_eager_ms']:.3f} eager; "
                f"{r['kernel_over_floor']:.2f}x floor "
                f"{r['floor_ns_per_token']:.2f}), flex "
                f"{r.get('flex_ns_per_token', float('nan')):.2f}, gathered "
                f"{r.get('gathered_ns_per_token') or float('nan'):.2f}; whole step "
                f"{r['step_ms']:.2f} ms")
    mem = result.get("memory")
    if mem:
        lines.append("memory (GiB): " + ", ".join(
            f"{k} {v / 2**30:.2f}" for k, v in mem.items() if k != "iteration_context"))
    dc = result.get("decode_context")
    if dc:
        for r in dc["shapes"]:
            lines.append(f"decode attention, {dc['layers']} layers, batch {r['batch']} x "
                         f"{r['context']}: gathered {r['gathered_ms']:.2f} ms, in place "
                         f"{r['in_place_ms']:.2f} ms")
        paged = dc.get("paged_ns_per_token")
        lines.append(f"per token of context: gathered {dc['gathered_ns_per_token']:.1f} ns, "
                     f"in place {dc['in_place_ns_per_token']:.1f} ns"
                     + (f", paged {paged:.1f} ns" if paged is not None else ""))
    pc = result.get("prefill_context")
    if pc:
        for r in pc["shapes"]:
            lines.append(f"prefill attention, {pc['layers']} layers, {r['new']} new over "
                         f"{r['cached']} cached: {r['ms']:.3f} ms")
        if pc["per_cached_ms"] is not None:
            lines.append(
                f"a cached token adds {pc['per_cached_ms'] * 1e6:.1f} ns, a new x cached pair "
                f"{pc['per_token_cached_ms'] * 1e9:.1f} ps (calibration's fit: "
                f"{pc['calibration_per_cached_ms'] * 1e6:.1f} ns, "
                f"{pc['calibration_per_token_cached_ms'] * 1e9:.1f} ps)")
    for d in result.get("decode", []):
        lines.append(
            f"decode ({d['mode']}) batch {d['batch']}: {d['step_ms']:.2f} ms/step, "
            f"{d['tokens_per_s']:.0f} tokens/s"
        )
    for r in result.get("routing", {}).get("runs", []):
        lines.append(
            f"load {r['load']} {r['policy']:>11}: TTFT p50 {r['ttft_p50_ms']:.0f} ms "
            f"p99 {r['ttft_p99_ms']:.0f} ms, {r['tokens_per_s']:.0f} tokens/s, "
            f"hit {r['hit_rate']:.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
