"""Where an iteration's time goes under the long-context mix: one worker alone, several sharing
one GPU, with and without CUDA MPS, at several prefill chunk sizes, in one run.

Run (on a GPU machine, from the repository root)::

    python -m bench.gpu.mix --configs 1:off,4:off,4:on --chunks 8192,2048 --seconds 40 \\
        --load 0.45 --json bench-out/mix.json

Each config ``W:MPS`` starts ``W`` engine processes on the one device (each its own
interpreter and CUDA context, as ``kvroute worker`` processes are; each takes ``--share`` of
the device and sizes its KV cache from it), with MPS ``off``, ``on`` or ``auto``
(:mod:`bench.gpu.mps`: started before the processes and stopped after them). Each process
drives the real engine loop (:class:`workers.engine.loop.Engine`: batcher, cache manager,
events) in process, with no HTTP, over its own slice of the long-context generator
(:mod:`bench.workloads`, seed = its rank) or, with ``--workload trace:FIRST:COUNT``, of the
packaged trace's window (every ``W``-th request), arrivals compressed so each process is offered
``load x --cold-rate / W`` prompt tokens/s: the same per-worker load at every ``W``. The
processes start each phase together (a barrier):

1. **Decode step**: one decode iteration of ``--decode-batch`` sequences over
   ``--decode-context`` tokens each (random block tables), replayed as the worker replays it
   (a CUDA graph), median of ``--repeats``; beside its floor, the weights plus the K/V read
   once at the copy bandwidth (measured in the first config whose processes run alone, else
   ``--bandwidth``).
2. **The mix**, once per ``--chunks`` value (``--max-num-batched-tokens``: the chunk cap),
   each from an empty cache, for ``--seconds``. Per iteration: its kind (decode only, prefill
   only, mixed), how it ran (decode graph, piecewise graphs, eager), wall time, host time until
   its work was issued, time waiting for the device after that, the executor thread's CPU
   time; and for the phase the process's CPU time per iteration (the event loop included),
   prompt and output tokens/s, TTFT and the interval between a request's tokens. For
   ``--profile-iterations`` passes of each sort, ``torch.profiler`` records every kernel:
   device time per iteration by kernel class (matrix products, attention, copies and
   indexing, other elementwise work), the busy share of those iterations' wall time, and the
   rate the matrix products and attention ran at (each pass's arithmetic from its plan,
   :func:`plan_flops`, over its kernels' time), for decode-only passes and for passes with
   prefill apart (each profiled pass alone; profiled passes are left out of the timings).

What the figures say is in ``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.gpu.mps import MODES, Mps, MpsError

__all__ = ["IterationRow", "TimedExecutor", "kernel_class", "main", "parse_configs",
           "parse_workload", "plan_flops", "process_workload", "run_config", "summarize_rows",
           "table"]

BS = 32
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


@dataclass(frozen=True, slots=True)
class IterationRow:
    """One iteration as the mix recorded it (seconds)."""

    kind: str  # decode, prefill or mixed
    path: str  # graph, piecewise or eager
    tokens: int
    decodes: int
    wall: float
    issue: float
    wait: float
    cpu: float


#: Kernel classes, first match by substring of the lowercased kernel name.
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "paged", "combine_shares", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "matmul", "cublas", "sm90_")),
    ("copy/index", ("memcpy", "memset", "copy", "index", "gather", "scatter", "cat_",
                    "catarray")),
    ("elementwise", ("elementwise", "reduce", "norm", "softmax", "vectorized", "silu",
                     "argmax", "triton_")),
)


def kernel_class(name: str) -> str:
    """The class of a kernel by its name (:data:`KERNEL_CLASSES`), ``other`` where none fits."""
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def parse_configs(text: str) -> list[tuple[int, str]]:
    """``"1:off,4:on"`` as ``[(1, "off"), (4, "on")]``.

    Raises:
        ValueError: a config that is not ``WORKERS:MODE`` with a positive count and a known
            mode.
    """
    out = []
    for item in text.split(","):
        workers, _, mode = item.strip().partition(":")
        if not workers.isdigit() or int(workers) < 1 or mode not in MODES:
            raise ValueError(f"--configs: {item!r} is not WORKERS:MODE (mode one of "
                             f"{', '.join(MODES)})")
        out.append((int(workers), mode))
    return out


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def summarize_rows(rows: Sequence[IterationRow]) -> dict[str, dict[str, float]]:
    """Per iteration kind (and ``all``): count, share of the wall time, and the means (ms) of
    wall, issue, wait and CPU time, with the mean tokens and decode steps."""
    total = sum(r.wall for r in rows) or 1.0
    groups: dict[str, list[IterationRow]] = {"all": list(rows)}
    for r in rows:
        groups.setdefault(r.kind, []).append(r)
        groups.setdefault(f"{r.kind}/{r.path}", []).append(r)
    out = {}
    for name, group in groups.items():
        if not group:
            continue
        out[name] = {"count": len(group), "time_share": sum(r.wall for r in group) / total,
                     **{f"{k}_ms": statistics.fmean(getattr(r, k) for r in group) * 1e3
                        for k in ("wall", "issue", "wait", "cpu")},
                     "tokens": statistics.fmean(r.tokens for r in group),
                     "decodes": statistics.fmean(r.decodes for r in group)}
    return out


class TimedExecutor:
    """The torch executor with each pass timed and, after ``profile_from`` passes, up to
    ``profile_count`` passes of each sort (decode only; with prefill) profiled one by one.
    Passes run in the executor's own pass thread (:meth:`TorchExecutor.submit`), as a
    worker runs them: cuDNN keeps its plans per thread, and another thread would build them
    again during the mix (~32 ms a shape, counted as host time)."""

    def __init__(self, ex: Any, profile_from: int, profile_count: int) -> None:
        self.ex = ex
        self.rows: list[IterationRow] = []
        self.passes = 0
        self.profile_from, self.profile_count = profile_from, profile_count
        self._profiled: dict[str, list[tuple[Any, float, dict[str, float]]]] = {
            "decode": [], "prefill": []}

    async def execute(self, plan: Any) -> tuple[dict[str, int], float]:
        return await asyncio.wrap_future(self.ex.submit(self.run, plan))

    def stats(self) -> dict[str, int]:
        return dict(self.ex.stats())

    def close(self) -> None:
        """Nothing to release: the passes ran in the executor's thread."""

    def kernels(self) -> dict[str, Any]:
        """Per sort of pass profiled, :func:`_kernel_breakdown` of its passes."""
        return {sort: _kernel_breakdown(runs) for sort, runs in self._profiled.items() if runs}

    def run(self, plan: Any) -> tuple[dict[str, int], float]:
        from torch.profiler import ProfilerActivity, profile

        self.passes += 1
        sort = "prefill" if plan.prefill else "decode"
        if self.passes > self.profile_from and len(self._profiled[sort]) < self.profile_count:
            import torch

            cuda = torch.cuda.is_available()  # on the CPU: CPU operators, no kernel to count
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
                         ) as prof:
                sampled, seconds = self.ex.run(plan)
            self._profiled[sort].append((_kernel_times(prof), seconds,
                                         plan_flops(self.ex.model.config, plan)))
            return sampled, seconds
        cpu = time.thread_time()
        sampled, seconds = self.ex.run(plan)
        cpu = time.thread_time() - cpu
        tokens = sum(c.num_new_tokens for c in plan.prefill) + len(plan.decode)
        kind = ("mixed" if plan.prefill and plan.decode else
                "prefill" if plan.prefill else "decode")
        graphs, piecewise = self.ex.graphs, self.ex.piecewise
        if not plan.prefill and graphs is not None and graphs.fits(plan.decode):
            path = "graph"
        elif piecewise is not None and piecewise.fits(tokens):
            path = "piecewise"
        else:
            path = "eager"
        self.rows.append(IterationRow(kind, path, tokens, len(plan.decode), seconds,
                                      self.ex.last_issue_s, self.ex.last_wait_s, cpu))
        return sampled, seconds


def _kernel_times(prof: Any) -> dict[str, float]:
    """ms of device time by kernel name in one profiled pass."""
    from torch.autograd import DeviceType

    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    return out


def plan_flops(config: Any, plan: Any) -> dict[str, float]:
    """A pass's arithmetic (:mod:`bench.gpu.flops`): ``matmul``, the projections and MLP of
    every token it computes, and ``attention``, each chunk's new tokens over its context and
    each decode step's token over its own."""
    from bench.gpu.flops import attention_flops, linear_flops

    tokens = sum(c.num_new_tokens for c in plan.prefill) + len(plan.decode)
    attention = sum(attention_flops(config, c.num_new_tokens, c.start) for c in plan.prefill)
    attention += sum(attention_flops(config, 1, d.context_len - 1) for d in plan.decode)
    return {"matmul": linear_flops(config, tokens), "attention": attention}


def _kernel_breakdown(runs: Sequence[tuple[dict[str, float], float, dict[str, float]]]
                      ) -> dict[str, Any]:
    """Over profiled passes (kernel ms by name, the pass's wall seconds, its FLOPs by class):
    device time per pass by kernel class (ms), the busy share of the passes' wall time, the
    rate each class of arithmetic ran at (TFLOP/s over its kernels' time), the kernels that
    took most."""
    passes = len(runs)
    by_name: dict[str, float] = {}
    flops: dict[str, float] = {}
    for _, _, f in runs:
        for cls, n in f.items():
            flops[cls] = flops.get(cls, 0.0) + n / passes
    for times, _, _ in runs:
        for name, ms in times.items():
            by_name[name] = by_name.get(name, 0.0) + ms
    by_class: dict[str, float] = {}
    for name, ms in by_name.items():
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + ms / passes
    busy = sum(by_class.values())
    wall = sum(seconds for _, seconds, _ in runs) / passes * 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    tflops = {cls: n / (by_class[cls] * 1e-3) / 1e12 for cls, n in flops.items()
              if by_class.get(cls)}
    return {"passes": passes, "wall_ms_per_pass": wall, "device_ms_per_pass": busy,
            "busy_share": busy / wall if wall else 0.0, "by_class_ms": by_class,
            "tflop_per_pass": {cls: n / 1e12 for cls, n in flops.items()}, "tflops": tflops,
            "top": [{"name": n[:90], "ms_per_pass": ms / passes} for n, ms in top]}


def process_workload(args: argparse.Namespace, rank: int, workers: int) -> list[Any]:
    """This process's requests: the long-context generator at seed ``rank``, or every
    ``workers``-th request of the trace's window from the ``rank``-th; arrivals compressed to
    ``load x cold_rate / workers`` prompt tokens/s."""
    from bench.workloads import GeneratorConfig, generate, load_trace, scale_rate

    if args.workload == "long_context":
        rows = generate("long_context", GeneratorConfig(requests=args.requests, rate=1.0), rank)
    else:
        first, count = args.trace_window
        rows = load_trace(args.trace or DEFAULT_TRACE, limit=first + count)[first:][rank::workers]
    rows = [r for r in rows if r.input_length + r.output_length <= args.max_model_len]
    tokens = sum(r.input_length for r in rows)
    span = (rows[-1].arrival_s - rows[0].arrival_s) or 1.0
    target = args.load * args.cold_rate / workers
    start = rows[0].arrival_s
    return scale_rate([replace(r, arrival_s=r.arrival_s - start) for r in rows],
                      target / (tokens / span))


def parse_workload(text: str) -> tuple[str, tuple[int, int]]:
    """``long_context`` or ``trace:FIRST:COUNT`` (``trace`` alone: its first 400 requests).

    Raises:
        ValueError: anything else.
    """
    if text == "long_context":
        return text, (0, 0)
    name, _, window = text.partition(":")
    first, _, count = (window or "0:400").partition(":")
    if name != "trace" or not first.isdigit() or not count.isdigit() or int(count) < 1:
        raise ValueError(f"--workload: {text!r} is not long_context or trace:FIRST:COUNT")
    return name, (int(first), int(count))


def _decode_step(ex: Any, batch: int, context: int, repeats: int) -> float:
    from bench.gpu.harness import median_ms
    from workers.cache.block_keys import Prompt
    from workers.engine.executor import DecodeStep, IterationPlan

    rng = random.Random(batch * context)
    width = -(-context // BS)
    steps = tuple(DecodeStep(f"s{i}", tuple(rng.randrange(ex.kv.num_blocks) for _ in range(width)),
                             context, 5, 0, Prompt((5,))) for i in range(batch))
    plan = IterationPlan(0, (), steps, (), ())
    return median_ms(lambda: ex.run(plan), repeats)


async def _phase(args: argparse.Namespace, ex: Any, cache: Any, plan: Any, chunk: int,
                 requests: Sequence[Any], rank: int) -> dict[str, Any]:
    from workers.cache.block_keys import Prompt
    from workers.cache.event_sink import EventSink
    from workers.engine.batcher import Batcher, EngineRequest
    from workers.engine.loop import Engine

    cache.reset_prefix_cache()
    timed = TimedExecutor(ex, args.profile_after, args.profile_iterations)
    batcher = Batcher(cache, max_num_batched_tokens=chunk, max_num_seqs=256,
                      max_model_len=args.max_model_len,
                      max_iteration_context=plan.iteration_context)
    engine = Engine(cache, batcher, timed, EventSink(), None, rank=rank)
    await engine.start()
    ttft: list[float] = []
    gaps: list[float] = []
    outputs = 0
    handles = []

    async def consume(handle: Any, due: float) -> None:
        nonlocal outputs
        last = None
        async for _ in handle:
            now = time.perf_counter()
            if last is None:
                ttft.append(now - due)
            else:
                gaps.append(now - last)
            last = now
            outputs += 1

    started, cpu = time.perf_counter(), time.process_time()
    end = started + args.seconds
    tasks = []
    for i, r in enumerate(requests):
        due = started + r.arrival_s
        if due >= end - args.tail:
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        handle = engine.submit(EngineRequest(f"r{rank}-{i}", Prompt(r.token_ids()),
                                             r.output_length, ignore_eos=True))
        handles.append(handle)
        tasks.append(asyncio.create_task(consume(handle, due)))
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    passes = timed.passes
    unanswered = len(handles) - len(ttft)
    for h in handles:
        h.cancel()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    await engine.stop()
    timed.close()
    rows = timed.rows
    prompt = sum(r.tokens - r.decodes for r in rows)
    return {"chunk": chunk, "seconds": elapsed, "requests": len(handles),
            "unanswered": unanswered, "passes": passes,
            "process_cpu_ms_per_pass": cpu / passes * 1e3 if passes else 0.0,
            "computed_prompt_tok_s": prompt / elapsed, "output_tok_s": outputs / elapsed,
            "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p90_s": _quantile(ttft, 0.9),
            "ttft_p99_s": _quantile(ttft, 0.99), "token_gap_p50_ms": _quantile(gaps, 0.5) * 1e3,
            "token_gap_p90_ms": _quantile(gaps, 0.9) * 1e3,
            "iterations": summarize_rows(rows), "kernels": timed.kernels()}


def _worker(args: argparse.Namespace, rank: int, workers: int, barrier: Any, results: Any,
            bandwidth: float | None) -> None:
    """One engine process: build, then each phase after the barrier; its result on the queue."""
    import torch

    from bench.gpu.harness import copy_bandwidth
    from openai_request.tokenizer import ByteTokenizer
    from workers.cache.cache_manager import CacheManager
    from workers.settings import WorkerSettings
    from workers.torch.engine import build_torch_executor, memory_plan_for

    out: dict[str, Any] = {"rank": rank}
    try:
        started = time.perf_counter()
        settings = WorkerSettings(engine="torch", torch_model=args.model, device=args.device,
                                  block_size=BS, seed=0, gpu_memory_utilization=args.share,
                                  max_num_batched_tokens=max(args.chunk_list),
                                  max_model_len=args.max_model_len)
        plan = memory_plan_for(settings)
        cache = CacheManager(plan.num_blocks, BS)
        ex = build_torch_executor(settings, ByteTokenizer(), cache)
        out["ready_s"] = time.perf_counter() - started
        out["kv_blocks"] = plan.num_blocks
        if workers == 1 and ex.kv.device.type == "cuda" and bandwidth is None:
            bandwidth = copy_bandwidth(ex.kv.device, gib=1)
        out["bandwidth_gb_s"] = (bandwidth or args.bandwidth * 1e9) / 1e9
        requests = process_workload(args, rank, workers)
        barrier.wait(timeout=args.barrier_timeout)
        out["decode_step_ms"] = _decode_step(ex, args.decode_batch, args.decode_context,
                                             args.repeats)
        per_token = ex.kv.block_bytes // BS
        weights = sum(p.numel() * p.element_size() for p in ex.model.parameters())
        read = weights + args.decode_batch * args.decode_context * per_token
        out["decode_floor_ms"] = read / (out["bandwidth_gb_s"] * 1e9) * 1e3
        out["phases"] = []
        for chunk in args.chunk_list:
            barrier.wait(timeout=args.barrier_timeout)
            out["phases"].append(asyncio.run(_phase(args, ex, cache, plan, chunk, requests,
                                                    rank)))
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30 if (
            ex.kv.device.type == "cuda") else 0.0
    except Exception as exc:  # reported, not raised: the parent prints every rank's outcome
        out["error"] = f"{type(exc).__name__}: {exc}"
        barrier.abort()
    results.put(out)


def run_config(args: argparse.Namespace, workers: int, mode: str,
               bandwidth: float | None) -> dict[str, Any]:
    """One config: ``workers`` engine processes under MPS ``mode``; each rank's result."""
    ctx = multiprocessing.get_context("spawn")
    with Mps(mode) as mps:
        barrier, results = ctx.Barrier(workers), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(args, rank, workers, barrier, results,
                                                   bandwidth), daemon=True)
                 for rank in range(workers)]
        for p in procs:
            p.start()
        ranks = []
        deadline = time.monotonic() + args.config_timeout
        servers = ""
        for _ in range(workers):
            try:
                ranks.append(results.get(timeout=max(1.0, deadline - time.monotonic())))
            except Exception:  # queue.Empty: a process died or hung past the deadline
                break
            if not servers:
                servers = mps.ask("get_server_list")
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        status = mps.status
    ranks.sort(key=lambda r: r["rank"])
    return {"workers": workers, "mps": mode, "mps_status": status, "mps_servers": servers,
            "ranks": ranks, "lost": workers - len(ranks)}


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def table(result: dict[str, Any]) -> str:
    """The run as text: per config, the decode step and each chunk's phase, means over ranks."""
    lines = [f"{result['model']}, load {result['load']} x {result['cold_rate']:.0f} tok/s "
             f"shared by the workers, {result['seconds']} s a phase"]
    for c in result["configs"]:
        ok = [r for r in c["ranks"] if "error" not in r]
        lines.append(f"== {c['workers']} worker(s), MPS {c['mps_status']}"
                     + (f", servers {c['mps_servers']}" if c["mps_servers"] else "")
                     + (f"; LOST {c['lost']}" if c["lost"] else ""))
        for r in c["ranks"]:
            if "error" in r:
                lines.append(f"   rank {r['rank']}: {r['error']}")
        if not ok:
            continue
        step = _mean([r["decode_step_ms"] for r in ok])
        floor = ok[0]["decode_floor_ms"]
        lines.append(
            f"   ready {_mean([r['ready_s'] for r in ok]):.0f} s; decode step "
            f"{result['decode_batch']} x {result['decode_context']}: {step:.2f} ms per worker"
            f" (floor {floor:.2f} ms at {ok[0]['bandwidth_gb_s']:.0f} GB/s: {step / floor:.2f}x;"
            f" {len(ok)} together: {step / len(ok) / floor:.2f}x of the floor per step)")
        for i, chunk in enumerate(result["chunks"]):
            ph = [r["phases"][i] for r in ok if len(r["phases"]) > i]
            if not ph:
                continue
            lines.append(
                f"   chunk {chunk}: per worker "
                f"{_mean([p['computed_prompt_tok_s'] for p in ph]):.0f} prompt tok/s computed, "
                f"{_mean([p['output_tok_s'] for p in ph]):.0f} output tok/s; TTFT p50 "
                f"{_mean([p['ttft_p50_s'] for p in ph]):.3f} p90 "
                f"{_mean([p['ttft_p90_s'] for p in ph]):.3f} p99 "
                f"{_mean([p['ttft_p99_s'] for p in ph]):.3f} s; token gap p50 "
                f"{_mean([p['token_gap_p50_ms'] for p in ph]):.1f} p90 "
                f"{_mean([p['token_gap_p90_ms'] for p in ph]):.1f} ms; "
                f"{sum(p['requests'] for p in ph)} requests, "
                f"{sum(p['unanswered'] for p in ph)} without a first token; process CPU "
                f"{_mean([p['process_cpu_ms_per_pass'] for p in ph]):.2f} ms a pass")
            kinds = sorted({k for p in ph for k in p["iterations"]})
            for k in kinds:
                g = [p["iterations"][k] for p in ph if k in p["iterations"]]
                lines.append(
                    f"      {k:>18}: n {sum(x['count'] for x in g):>5}, "
                    f"time {_mean([x['time_share'] for x in g]):>5.1%}, wall "
                    f"{_mean([x['wall_ms'] for x in g]):7.2f} ms = issue "
                    f"{_mean([x['issue_ms'] for x in g]):6.2f} + wait "
                    f"{_mean([x['wait_ms'] for x in g]):6.2f} (+ sampling); thread CPU "
                    f"{_mean([x['cpu_ms'] for x in g]):6.2f}; tokens "
                    f"{_mean([x['tokens'] for x in g]):6.0f}, decodes "
                    f"{_mean([x['decodes'] for x in g]):4.1f}")
            for sort in ("decode", "prefill"):
                prof = [p["kernels"][sort] for p in ph if sort in p["kernels"]]
                if not prof:
                    continue
                classes = sorted({k for x in prof for k in x["by_class_ms"]})
                lines.append(
                    f"      kernels, {sort} passes ({sum(x['passes'] for x in prof)} profiled): "
                    f"device {_mean([x['device_ms_per_pass'] for x in prof]):.2f} ms a pass of "
                    f"{_mean([x['wall_ms_per_pass'] for x in prof]):.2f} wall (busy "
                    f"{_mean([x['busy_share'] for x in prof]):.0%}): " + ", ".join(
                        f"{k} {_mean([x['by_class_ms'].get(k, 0.0) for x in prof]):.2f}"
                        for k in classes))
                rates = sorted({k for x in prof for k in x.get("tflops", {})})
                if rates:
                    lines.append("         arithmetic a pass and its rate: " + ", ".join(
                        f"{k} {_mean([x['tflop_per_pass'][k] for x in prof]):.2f} TFLOP at "
                        f"{_mean([x['tflops'][k] for x in prof if k in x['tflops']]):.0f} "
                        f"TFLOP/s" for k in rates))
                for t in prof[0]["top"][:5]:
                    lines.append(f"         {t['ms_per_pass']:7.3f} ms  {t['name']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.mix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--configs", default="1:off,4:off,4:auto",
      help="WORKERS:MPS items, MPS off, auto or on (default 1:off,4:off,4:auto)")
    a("--chunks", default="8192,2048", help="--max-num-batched-tokens values, one phase each")
    a("--model", default="llama-1b")
    a("--device", default="auto")
    a("--share", type=float, default=0.225, help="each process's share of the device memory")
    a("--load", type=float, default=0.45, help="offered prompt tokens/s over --cold-rate")
    a("--cold-rate", type=float, default=180_000.0, help="the device's cold prefill tokens/s")
    a("--seconds", type=float, default=40.0, help="length of each mix phase")
    a("--tail", type=float, default=5.0, help="no arrivals in a phase's last seconds")
    a("--requests", type=int, default=400, help="requests generated per process")
    a("--workload", default="long_context",
      help="long_context (the generator, seed = rank) or trace:FIRST:COUNT (the packaged "
           "trace's window, dealt to the processes in turn)")
    a("--trace", type=Path, default=None, help="Mooncake trace (default: bench/data)")
    a("--max-model-len", type=int, default=65536)
    a("--decode-batch", type=int, default=24)
    a("--decode-context", type=int, default=11264)
    a("--repeats", type=int, default=20)
    a("--bandwidth", type=float, default=4217.0,
      help="GB/s for the floor when no config runs one process alone")
    a("--profile-after", type=int, default=60, help="passes before any is profiled")
    a("--profile-iterations", type=int, default=8,
      help="passes profiled of each sort, decode only and with prefill (0: none)")
    a("--barrier-timeout", type=float, default=600.0)
    a("--config-timeout", type=float, default=900.0)
    a("--json", dest="json_path", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configs = parse_configs(args.configs)
        args.workload, args.trace_window = parse_workload(args.workload)
        args.chunk_list = [int(x) for x in args.chunks.split(",")]
        if any(c < BS for c in args.chunk_list):
            raise ValueError(f"--chunks must each be at least {BS}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {k: getattr(args, k) for k in (
        "model", "load", "cold_rate", "seconds", "decode_batch", "decode_context", "share",
        "workload")}
    result["chunks"], result["configs"] = args.chunk_list, []
    bandwidth = None
    for workers, mode in configs:
        try:
            config = run_config(args, workers, mode, bandwidth)
        except MpsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if workers == 1 and config["ranks"] and "bandwidth_gb_s" in config["ranks"][0]:
            bandwidth = config["ranks"][0]["bandwidth_gb_s"] * 1e9
        result["configs"].append(config)
        print(f"# {json.dumps(config)}", flush=True)
    print(table(result), flush=True)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0 if all(not c["lost"] and all("error" not in r for r in c["ranks"])
                    for c in result["configs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
