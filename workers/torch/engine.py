"""The torch engine: a real Llama-style decoder computing each iteration on the GPU (or CPU),
its KV cache in the cache manager's blocks.

:func:`build_torch_executor` assembles it from the worker settings; :class:`TorchExecutor`
implements the executor contract (:mod:`workers.engine.executor`): perform the plan's block copies,
compute every prefill chunk and decode step in one forward pass over a flat token batch
(:class:`~workers.torch.model.PagedBatch`), and sample greedily (argmax over the tokenizer's
ids) from each sampling position. The router cannot tell it from the simulated engine except by
speed: the events, the API and the cache decisions are the cache manager's, shared by both.

PyTorch is an optional dependency: this module imports it only inside functions, and the model
and KV modules (which import it at the top) only from there, so a worker without PyTorch runs
the sim engine and names the missing extra only when asked for the torch engine.

Memory: the KV cache's size is decided before the cache manager exists
(:func:`kv_blocks_for`). On CUDA that builds the model, profiles the worst iteration and sizes
the cache from what is left of the worker's ``--gpu-memory-utilization`` share
(:mod:`workers.torch.memory`); the model is kept for :func:`build_torch_executor`. On the CPU
it is ``--kv-memory-gb``, or :data:`CPU_KV_BYTES`.

A failed pass (CUDA out of memory above all) raises out of :meth:`TorchExecutor.execute` after
the allocator's cache is emptied; the engine loop preempts the pass's requests and recomputes
them in smaller batches (:meth:`workers.engine.batcher.Batcher.recover`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from openai_request.tokenizer import Tokenizer, load_tokenizer
from workers.cache.cache_manager import CacheManager
from workers.engine.executor import BlockTransfer, IterationPlan
from workers.settings import WorkerSettings

if TYPE_CHECKING:
    import torch

    from workers.torch.graphs import DecodeGraphs
    from workers.torch.kv import PagedKV
    from workers.torch.memory import MemoryPlan
    from workers.torch.model import Decoder, ModelConfig, PagedBatch
    from workers.torch.piecewise import PiecewiseGraphs

T = TypeVar("T")

__all__ = [
    "CPU_KV_BYTES",
    "INSTALL_HINT",
    "TorchEngineError",
    "TorchExecutor",
    "build_torch_executor",
    "capture_at_start",
    "kv_blocks_for",
    "memory_plan_for",
    "resolve_model",
]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'kvroute[torch]'"
#: Allowed beyond the CUDA graphs' measured memory (their second capture may round apart).
GRAPH_MARGIN_BYTES = 256 << 20
#: KV cache bytes on the CPU when ``--kv-memory-gb`` is not given.
CPU_KV_BYTES = 512 << 20


class TorchEngineError(ValueError):
    """The torch engine cannot start with these settings (no PyTorch, no such model or
    device, too little memory); the message says what to change."""


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise TorchEngineError(
            f"--engine torch needs PyTorch, which is not installed: {INSTALL_HINT}"
        ) from None
    return torch


def resolve_device(name: str) -> torch.device:
    """``cuda``, ``cpu`` or ``auto`` (CUDA when available) as a device.

    Raises:
        TorchEngineError: CUDA asked for and not available, or an unknown name.
    """
    torch = _torch()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cuda", "cpu") and not name.startswith("cuda:"):
        raise TorchEngineError(f"--device must be cuda, cpu or auto, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TorchEngineError(f"--device {name}: PyTorch sees no CUDA device")
    return torch.device(name)


def resolve_model(name: str) -> tuple[ModelConfig, Path | None]:
    """A configuration name or a local model folder: the config and the folder (if any).

    Raises:
        TorchEngineError: neither a known name nor a folder with ``config.json``.
    """
    _torch()
    from workers.torch.model import CONFIGS, config_from_folder

    if name in CONFIGS:
        return CONFIGS[name], None
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise TorchEngineError(
            f"--torch-model {name!r} is neither a configuration ({', '.join(CONFIGS)}) nor a "
            f"local model folder (weights are never downloaded)"
        )
    try:
        return config_from_folder(folder), folder
    except (ValueError, KeyError) as exc:
        raise TorchEngineError(f"--torch-model {name}: {exc}") from None


def _dtype(device: torch.device) -> torch.dtype:
    torch = _torch()
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def kv_blocks_for(settings: WorkerSettings) -> int:
    """How many device KV blocks the torch engine's memory budget holds
    (:func:`memory_plan_for`).

    Raises:
        TorchEngineError: bad model or device, or a budget that does not fit.
    """
    return memory_plan_for(settings).num_blocks


# The model :func:`memory_plan_for` built and profiled, kept for :func:`build_torch_executor`
# (settings, model, plan): a worker builds its model once.
_prepared: list[tuple[WorkerSettings, Decoder, MemoryPlan]] = []


def memory_plan_for(settings: WorkerSettings) -> MemoryPlan:
    """The worker's device memory by use (:mod:`workers.torch.memory`): on CUDA the model is
    built and the worst iteration profiled (once; the model is kept for
    :func:`build_torch_executor`); on the CPU the KV cache is ``--kv-memory-gb`` or
    :data:`CPU_KV_BYTES` and nothing else is counted.

    Raises:
        TorchEngineError: bad model or device, or a budget that does not fit (the message
            says which setting to change).
    """
    from workers.torch.kv import bytes_per_block
    from workers.torch.memory import MemoryPlan, iteration_context, plan_memory

    config, _ = resolve_model(settings.torch_model)
    device = resolve_device(settings.device)
    dtype = _dtype(device)
    per_block = bytes_per_block(
        config.num_layers, settings.block_size, config.num_kv_heads, config.head_dim, dtype
    )
    context = iteration_context(settings)
    if device.type != "cuda":
        kv = (CPU_KV_BYTES if settings.kv_memory_gb is None
              else int(settings.kv_memory_gb * 2**30))
        if kv // per_block < 1:
            raise TorchEngineError(
                f"a KV budget of {kv / 2**30:.3f} GiB holds no {per_block}-byte block of "
                f"{config.name}; raise --kv-memory-gb")
        return MemoryPlan(budget=0, weights=0, iteration=0, graphs=0, context=0,
                          kv=kv // per_block * per_block, num_blocks=kv // per_block,
                          iteration_context=context)
    for held, _, plan in _prepared:
        if held == settings:
            return plan
    model = _build_model(settings, config, device)
    iteration = _profile(model, settings)
    graphs = _graph_pool(model, settings) + GRAPH_MARGIN_BYTES if settings.cuda_graphs else 0
    total = _torch().cuda.mem_get_info(device)[1]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = None if settings.kv_memory_gb is None else int(settings.kv_memory_gb * 2**30)
    try:
        plan = plan_memory(total=total, utilization=settings.gpu_memory_utilization,
                           weights=weights, iteration=iteration, graphs=graphs,
                           block_bytes=per_block, kv_bytes=kv_bytes, iteration_tokens=context)
    except ValueError as exc:
        raise TorchEngineError(str(exc)) from None
    log.info("device memory plan: %s", plan.describe())
    _prepared[:] = [(settings, model, plan)]
    return plan


def _graph_pool(model: Decoder, settings: WorkerSettings) -> int:
    """The memory the worker's CUDA graphs hold: every graph captured over a cache of one
    block, measured, and released (the worker captures them again over its real cache)."""
    torch = _torch()
    from workers.torch.kv import PagedKV

    c = model.config
    started = time.perf_counter()
    kv = PagedKV(num_layers=c.num_layers, block_size=settings.block_size,
                 kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_blocks=1, host_blocks=0,
                 dtype=model.dtype, device=model.device)
    executor = TorchExecutor(model, kv, cuda_graphs=True)
    try:
        capture_at_start(executor, settings)
        measured = executor.graph_bytes
    finally:
        del executor, kv
        gc.collect()  # the captured pieces refer to the executor: free the graphs' pools now
        torch.cuda.empty_cache()
    log.info("the CUDA graphs hold %.2f GiB (measured over a one-block cache in %.1f s)",
             measured / 2**30, time.perf_counter() - started)
    return measured


def _profile(model: Decoder, settings: WorkerSettings) -> int:
    """The worst iteration's working memory (:func:`workers.torch.memory.profile_iteration`),
    run over a cache of one block."""
    torch = _torch()
    from workers.torch.kv import PagedKV
    from workers.torch.memory import profile_iteration, worst_case_plans

    c = model.config
    kv = PagedKV(num_layers=c.num_layers, block_size=settings.block_size,
                 kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_blocks=1, host_blocks=0,
                 dtype=model.dtype, device=model.device)
    executor = TorchExecutor(model, kv, cuda_graphs=False)
    try:
        with torch.inference_mode():
            return profile_iteration(executor.run, worst_case_plans(settings, 0), model.device)
    except torch.cuda.OutOfMemoryError:
        raise TorchEngineError(
            f"CUDA ran out of memory running the worst iteration ({settings.max_num_batched_tokens}"
            f" tokens over {settings.max_model_len} of context): lower --max-num-batched-tokens "
            f"or --max-model-len") from None
    finally:
        del executor, kv
        torch.cuda.empty_cache()


def _build_model(settings: WorkerSettings, config: ModelConfig, device: torch.device) -> Decoder:
    torch = _torch()
    from workers.torch.model import Decoder, load_checkpoint

    _, folder = resolve_model(settings.torch_model)
    try:
        model = Decoder(config, _dtype(device), device)
    except torch.cuda.OutOfMemoryError:
        raise TorchEngineError(f"{config.name}'s weights do not fit on {device}") from None
    if folder is None:
        model.init_random(settings.seed)
    else:
        try:
            load_checkpoint(model, folder)
        except ValueError as exc:
            raise TorchEngineError(str(exc)) from None
    model.eval()
    return model


def build_torch_executor(
    settings: WorkerSettings, tokenizer: Tokenizer, cache: CacheManager
) -> TorchExecutor:
    """Build the torch engine's executor for a worker.

    The KV storage holds exactly the cache manager's ``num_blocks`` device blocks and
    ``host_blocks`` host blocks (size the manager with :func:`kv_blocks_for` first).

    Raises:
        TorchEngineError: no PyTorch, unknown model or device, a tokenizer that does not fit
            the model, or too little memory.
    """
    from workers.torch.kv import PagedKV

    config, folder = resolve_model(settings.torch_model)
    device = resolve_device(settings.device)
    if folder is not None:
        _check_tokenizer(folder, settings, tokenizer)
    if tokenizer.vocab_size > config.vocab_size:
        raise TorchEngineError(
            f"the tokenizer has {tokenizer.vocab_size} ids but {config.name} embeds only "
            f"{config.vocab_size}"
        )
    plan = memory_plan_for(settings) if device.type == "cuda" else None
    held = [m for s, m, _ in _prepared if s == settings]
    _prepared.clear()
    model = held[0] if held else _build_model(settings, config, device)
    dtype = _dtype(device)
    try:
        kv = PagedKV(
            num_layers=config.num_layers,
            block_size=cache.block_size,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            num_blocks=cache.pool.num_blocks,
            host_blocks=cache.pool.host_blocks,
            dtype=dtype,
            device=device,
        )
    except ValueError as exc:
        raise TorchEngineError(str(exc)) from None
    executor = TorchExecutor(model, kv, vocab_limit=tokenizer.vocab_size,
                             cuda_graphs=settings.cuda_graphs and device.type == "cuda",
                             memory=plan)
    capture_at_start(executor, settings)
    started = time.perf_counter()
    n = executor.prepare_chunks(settings.max_num_batched_tokens, settings.max_model_len)
    if n:
        _torch().cuda.empty_cache()
        log.info("built cuDNN's plans of %d chunk shapes in %.1f s", n,
                 time.perf_counter() - started)
    return executor


def capture_at_start(executor: TorchExecutor, settings: WorkerSettings) -> None:
    """Capture every CUDA graph the executor can use with these settings, before it serves:
    the piecewise token buckets, then the decode shapes (a worker's start; logged).

    Raises:
        TorchEngineError: CUDA ran out of memory while capturing.
    """
    torch = _torch()
    device = executor.kv.device
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    try:
        if executor.piecewise is not None:
            started = time.perf_counter()
            n = executor.piecewise.capture_buckets(settings.max_num_batched_tokens)
            log.info("captured the piecewise graphs of %d token buckets in %.1f s", n,
                     time.perf_counter() - started)
        if executor.graphs is not None:
            started = time.perf_counter()
            n = executor.graphs.capture_shapes(settings.max_num_seqs, settings.max_model_len)
            log.info("captured the decode graphs of %d shapes in %.1f s", n,
                     time.perf_counter() - started)
    except torch.cuda.OutOfMemoryError:
        kv = executor.kv.num_blocks * executor.kv.block_bytes / 2**30
        raise TorchEngineError(
            f"CUDA ran out of memory capturing the CUDA graphs beside {kv:.1f} GiB of KV "
            f"cache: lower --kv-memory-gb, or --max-num-seqs / --max-model-len, or pass "
            f"--no-cuda-graphs"
        ) from None
    if device.type != "cuda":
        return
    # The captures' warm-up passes leave eager memory cached: give it back, so that what stays
    # reserved beyond ``before`` is the graphs' own pool and static buffers.
    torch.cuda.empty_cache()
    executor.graph_bytes = torch.cuda.memory_reserved(device) - before
    plan = executor.memory
    if plan is None:
        return
    # What a pass may still take beside everything reserved now: the worst iteration.
    need = torch.cuda.memory_reserved(device) + plan.iteration + plan.context
    if need > plan.budget:
        raise TorchEngineError(
            f"the CUDA graphs took {executor.graph_bytes / 2**30:.2f} GiB (allowed "
            f"{plan.graphs / 2**30:.2f}), leaving the worst iteration no room in the worker's "
            f"{plan.budget / 2**30:.2f} GiB: lower --kv-memory-gb or --max-num-seqs, or pass "
            f"--no-cuda-graphs")


def _check_tokenizer(folder: Path, settings: WorkerSettings, tokenizer: Tokenizer) -> None:
    # The router tokenizes with --tokenizer too: the worker must use that same file, and it
    # must be the model's own.
    if not (folder / "tokenizer.json").is_file():
        return
    if settings.tokenizer is None:
        raise TorchEngineError(
            f"{folder} holds its tokenizer: start the worker (and the router) with "
            f"--tokenizer {folder / 'tokenizer.json'}"
        )
    if load_tokenizer(str(folder)).identity != tokenizer.identity:
        raise TorchEngineError(f"--tokenizer {settings.tokenizer} is not {folder}'s tokenizer")


class TorchExecutor:
    """Runs iterations on a :class:`~workers.torch.model.Decoder` over a :class:`PagedKV`.

    Args:
        model: the decoder.
        kv: its KV storage; block ids are the cache manager's.
        vocab_limit: sample only ids below this (the tokenizer's vocabulary), default all.
        cuda_graphs: run decode-only iterations padded to fixed shapes
            (:mod:`workers.torch.graphs`), and the others of at most 2,048 tokens padded to a
            token bucket in per-layer pieces (:mod:`workers.torch.piecewise`): replayed CUDA
            graphs on CUDA, the padded forwards eagerly on the CPU (what the tests use to
            check the padding).

    Notes:
        1. One plan at a time (the batcher never overlaps two); :meth:`execute` runs the
           forward in the executor's one thread so the event loop keeps serving while the
           device works.
        2. Sampling is greedy: the same prompt gives the same tokens on any worker with the
           same model, after any preemption, up to the device's rounding.
    """

    def __init__(self, model: Decoder, kv: PagedKV, *, vocab_limit: int | None = None,
                 cuda_graphs: bool = False, memory: MemoryPlan | None = None) -> None:
        self.model = model
        self.kv = kv
        self.memory = memory
        self.graph_bytes = 0  # the graph pool, measured at capture
        self.out_of_memory = 0  # passes that ran out of device memory
        self.cache_releases = 0  # times the allocator's cache was emptied after a pass
        # The last pass's host time until its work was issued, and the wait for the device
        # after that (what the benchmarks split an iteration's time by).
        self.last_issue_s = self.last_wait_s = 0.0
        # Reserved memory past which the allocator's cache is emptied after a pass: then the
        # next pass, which needs at most the profiled worst iteration, stays in the budget
        # however the cache fragments.
        self._release_above = (None if memory is None
                               else memory.budget - memory.context - memory.iteration)
        # One thread runs every pass (and builds cuDNN's plans first: they are per thread).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-pass")
        self.block_size = kv.block_size
        self.vocab_limit = model.config.vocab_size if vocab_limit is None else vocab_limit
        self._layers = kv.layers()
        self._rows = kv.rows()
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if cuda_graphs:
            from workers.torch.graphs import MAX_SLOTS, DecodeGraphs
            from workers.torch.paged import kernel_available
            from workers.torch.piecewise import PiecewiseGraphs

            capture = kv.device.type == "cuda"
            self.graphs = DecodeGraphs(
                model, self._layers, self._rows, kv.scratch_block, kv.block_size,
                capture=capture, max_slots=None if kernel_available(kv.device) else MAX_SLOTS)
            self.piecewise = PiecewiseGraphs(model, self._layers, self._rows, kv.scratch_block,
                                             kv.block_size, capture=capture)

    async def execute(self, plan: IterationPlan) -> tuple[dict[str, int], float]:
        """Compute the plan and sample greedily.

        Returns:
            The sampled tokens, and the seconds the pass took (copies included).
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.run, plan)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` in the thread that runs the passes (where cuDNN's plans are
        cached): what a caller that times or profiles passes runs them through."""
        return self._thread.submit(fn, *args)

    def prepare_chunks(self, max_new: int, max_context: int) -> int:
        """Build, in the thread that runs the passes, cuDNN's plan of every bulk shape that
        chunks of at most ``max_new`` tokens over ``max_context`` positions can use
        (:mod:`workers.torch.bulk`: cuDNN keeps its plans per thread, ~32 ms each to build).

        Returns:
            The shapes built (0 where chunks do not split).
        """
        from workers.torch import bulk, model

        device = self.kv.device
        if not (model.SPLIT_CHUNKS and bulk.available(device)):
            return 0
        c = self.model.config
        shapes = bulk.bulk_shapes(max_new, max_context)
        return self._thread.submit(bulk.warm, shapes, c.num_heads, c.num_kv_heads,
                                   c.head_dim, self.model.dtype, device).result()

    def run(self, plan: IterationPlan) -> tuple[dict[str, int], float]:
        """:meth:`execute`, synchronously.

        Raises:
            torch.cuda.OutOfMemoryError: the pass ran out of device memory (the allocator's
                cache is emptied first, so a smaller pass can run next).
        """
        torch = _torch()
        started = time.perf_counter()
        try:
            logits = self.logits(plan)
            issued = time.perf_counter()
            if self.kv.device.type == "cuda":  # sampling waits for the device anyway
                torch.cuda.current_stream(self.kv.device).synchronize()
        except torch.cuda.OutOfMemoryError:
            self.out_of_memory += 1
            if self.kv.device.type == "cuda":
                torch.cuda.empty_cache()
            raise
        self.last_issue_s, self.last_wait_s = issued - started, time.perf_counter() - issued
        if (self._release_above is not None
                and torch.cuda.memory_reserved(self.kv.device) > self._release_above):
            torch.cuda.empty_cache()
            self.cache_releases += 1
        sampled: dict[str, int] = {}
        if logits:
            ids = list(logits)
            best = self._stack(logits, ids)[:, : self.vocab_limit].argmax(dim=-1).tolist()
            sampled = dict(zip(ids, best, strict=True))
        return sampled, time.perf_counter() - started

    def copy_blocks(self, transfers: Sequence[BlockTransfer]) -> None:
        """Perform block copies outside a pass (an allocation that received KV needed them),
        waiting for the device."""
        torch = _torch()
        with torch.inference_mode():
            self.kv.transfer(transfers)
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream(self.kv.device).synchronize()

    def stats(self) -> dict[str, int]:
        """Memory by use (bytes; ``memory_*``, CUDA only) and passes that ran out of it."""
        torch = _torch()
        out = {"out_of_memory_passes": self.out_of_memory, "cache_releases": self.cache_releases}
        device = self.kv.device
        if device.type == "cuda":
            out["memory_reserved_bytes"] = torch.cuda.memory_reserved(device)
            out["memory_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
            out["memory_graph_bytes"] = self.graph_bytes
            if self.memory is not None:
                out["memory_budget_bytes"] = self.memory.budget
                out["memory_kv_bytes"] = self.memory.kv
                out["memory_iteration_bytes"] = self.memory.iteration
        return out

    def logits(self, plan: IterationPlan) -> dict[str, torch.Tensor]:
        """Perform the plan's copies, compute it, and return each sampling request's logits
        (float32, over the model's whole vocabulary)."""
        torch = _torch()
        with torch.inference_mode():
            self.kv.transfer(plan.transfers)
            if not plan.prefill and not plan.decode:
                return {}
            if self.graphs is not None and not plan.prefill and self.graphs.fits(plan.decode):
                out = self.graphs.logits(plan.decode)
                return dict(zip((d.request_id for d in plan.decode), out.unbind(0), strict=True))
            batch, ids = self._batch(plan)
            if self.piecewise is not None and self.piecewise.fits(len(batch.token_ids)):
                out = self.piecewise.logits(batch)
            else:
                out = self.model.forward_paged(batch, self._layers, self._rows)
            return dict(zip(ids, out.unbind(0), strict=True))

    def _stack(self, logits: dict[str, torch.Tensor], ids: Sequence[str]) -> torch.Tensor:
        return _torch().stack([logits[i] for i in ids])

    def _batch(self, plan: IterationPlan) -> tuple[PagedBatch, list[str]]:
        torch = _torch()
        from workers.torch.model import PagedBatch

        bs, vocab = self.block_size, self.model.config.vocab_size
        stride = 2 * self.model.config.num_layers * bs
        device = self.kv.device
        # Host inputs in ``array('q')`` and per-chunk tensor arithmetic: ``torch.tensor`` over
        # lists of Python ints, and a generator per token, cost milliseconds an iteration at
        # 8k tokens on the device's host (``docs/gpu.md``).
        tokens = array("q")
        slot_parts: list[Any] = []
        position_parts: list[Any] = []
        prefill: list[tuple[int, int, int, Any]] = []
        rows: list[int] = []
        ids: list[str] = []
        for c in plan.prefill:
            first, end = len(tokens), c.start + c.num_new_tokens
            tokens.extend(c.token_ids)
            pos = torch.arange(c.start, end, dtype=torch.long)
            used = torch.frombuffer(array("q", c.block_ids[: -(-end // bs)]), dtype=torch.long)
            position_parts.append(pos)
            slot_parts.append(used[pos // bs] * stride + pos % bs)
            prefill.append((first, c.start, c.num_new_tokens, used.to(device)))
            if c.samples:
                rows.append(len(tokens) - 1)
                ids.append(c.request_id)
        decode_offset = len(tokens)
        tables = lens = None
        width = 0
        if plan.decode:
            width = max(-(-d.context_len // bs) for d in plan.decode)
            flat = array("q")
            for d in plan.decode:
                used = -(-d.context_len // bs)
                flat.extend(d.block_ids[:used])
                flat.extend(_zeros(width - used))
            tables = torch.frombuffer(flat, dtype=torch.long).view(len(plan.decode), width)
            tables = tables.to(device)
            lens = torch.tensor([d.context_len for d in plan.decode], dtype=torch.long).to(device)
            positions = [d.context_len - 1 for d in plan.decode]
            rows.extend(range(len(tokens), len(tokens) + len(plan.decode)))
            ids.extend(d.request_id for d in plan.decode)
            tokens.extend(d.token_id for d in plan.decode)
            pos = torch.tensor(positions, dtype=torch.long)
            position_parts.append(pos)
            slot_parts.append(torch.tensor([d.block_ids[p // bs] for d, p in
                                            zip(plan.decode, positions, strict=True)],
                                           dtype=torch.long) * stride + pos % bs)
        token_ids = torch.frombuffer(tokens, dtype=torch.long)
        outside = (token_ids < 0) | (token_ids >= vocab)
        if bool(outside.any()):
            bad = int(token_ids[outside][0])
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
        positions_all = torch.cat(position_parts)
        batch = PagedBatch(
            token_ids=token_ids.to(device),
            positions=positions_all.to(device),
            slot_rows=torch.cat(slot_parts).to(device),
            prefill=tuple(prefill),
            decode_offset=decode_offset,
            decode_tables=tables,
            decode_lens=lens,
            logit_rows=torch.tensor(rows, dtype=torch.long).to(device),
            decode_max_context=width * bs,
        )
        return batch, ids


def _zeros(n: int) -> array[int]:
    return array("q", bytes(8 * n))
