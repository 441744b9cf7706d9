"""The torch engine on a real device: prefill, cached prefill, decode, and routing over engines.

Run: ``python -m bench.gpu [--json] [--model llama-1b] [--device auto]``.

Sections (``docs/gpu.md`` holds the figures and what they mean):

- ``ttft``: one 8,192-token prompt computed cold; the same prompt with 8,128 tokens cached (its
  first 254 blocks already in the request's block table) and 64 new; 64 new tokens alone; the
  cached pass mixed with 32 decode steps over 1,024-token contexts. Each is one executor pass,
  sampling included, median of ``--repeats``; eager and (on CUDA) padded
  into per-layer piecewise graphs (:mod:`workers.torch.piecewise`), in one run; and the first
  piecewise pass of three token buckets (64, 128, 2,048), which captures that bucket's graphs.
- ``prompt``: one cold prompt of ``--prompt-tokens`` alone, prefilled in chunks of each size in
  ``--chunk-tokens`` as a worker with that ``--max-num-batched-tokens`` computes it (one pass a
  chunk, back to back): the isolated prefill time a time to first token is judged against.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu.attention import bench_attention
from bench.gpu.decode import bench_decode
from bench.gpu.decode_context import bench_decode_context
from bench.gpu.harness import BS, executor
from bench.gpu.paged_decode import bench_paged_decode
from bench.gpu.prefill_context import bench_prefill_context
from bench.gpu.prompt import bench_prompt
from bench.gpu.report import table
from bench.gpu.routing import load_trace, replay, trace_prompt
from bench.gpu.ttft import bench_ttft
from bench.workloads import DEFAULT_TRACE
from workers.cache.cache_manager import CacheManager


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
    parser.add_argument("--prompt-tokens", type=int, default=8192,
                        help="prompt: the cold prompt's length")
    parser.add_argument("--chunk-tokens", default="8192,2048",
                        help="prompt: chunk sizes, comma-separated")
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
    ex = executor(args, cache)
    result["device"] = torch.cuda.get_device_name() if ex.kv.device.type == "cuda" else "cpu"
    result["torch"] = torch.__version__
    result["params"] = ex.model.config.num_params
    cold_rate = None
    if "ttft" in sections:
        result["ttft"] = bench_ttft(args, ex, cache)
        cold_rate = result["ttft"]["cold_tokens_per_s"]
        _log(args, "ttft", result["ttft"])
    if "prompt" in sections:
        try:
            result["prompt"] = bench_prompt(args, ex, cache)
        except ValueError as exc:
            parser.error(str(exc))
        _log(args, "prompt", result["prompt"])
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
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


def _log(args: argparse.Namespace, section: str, value: Any) -> None:
    if args.json:
        print(f"# {section}: {json.dumps(value)}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
