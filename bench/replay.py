"""Trace replay: every policy over the same workload on a simulated cluster, side by side.

``python -m bench.replay --trace FILE --workers 8 --policies all --json OUT`` (also
``kvroute bench replay``, through :func:`add_bench_parser` and :func:`run_bench`). Each policy
runs on a fresh simulated cluster (:mod:`bench.sim`) in virtual time; the bounds
(:mod:`bench.bounds`) are computed once per workload. Prints a table, writes JSON (with
``--json``) and PNG plots (with ``--plot-dir``). ``--sensitivity`` repeats the run at event
lags of 0, 10 ms, 100 ms and 1 s. ``--live URL`` replays against a running router instead
(:mod:`bench.live`). ``--per-worker`` adds each policy's per-worker table (requests, TTFT,
decode context: where a skewed median comes from) to the terminal and the JSON.

Settings are read here once and passed down frozen.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvroute.argtypes import positive_float, positive_int
from workers.timing import DEFAULT_TIMING, TIMING_MODELS

__all__ = ["DEFAULT_TRACE", "add_bench_parser", "build_parser", "main", "run_bench"]

#: The default trace, relative to the repository root.
DEFAULT_TRACE = Path("..") / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
SENSITIVITY_LAGS_MS = (0.0, 10.0, 100.0, 1000.0)
_REPO = Path(__file__).resolve().parent.parent


def _add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--trace", help=f"Mooncake JSONL trace (default {DEFAULT_TRACE}, from the repo root)")
    a("--generator", default="trace",
      choices=["trace", "system_prompt", "multi_turn", "agentic", "images"],
      help="workload: the trace, or a generator (default trace)")
    a("--requests", type=positive_int,
      help="requests: the trace's first N, or how many to generate (default all / 2000)")
    a("--rate", type=positive_float, default=20.0,
      help="generators: new requests or sessions per second before --rate-scale (default 20)")
    a("--workers", type=positive_int, default=8, help="simulated workers (default 8)")
    a("--policies", default="all", help="comma-separated policy names, or all (default)")
    a("--capacity-tokens", type=positive_int, default=500_000,
      help="KV cache per worker in tokens (default 500000)")
    a("--rate-scale", type=positive_float, default=1.0,
      help="multiply the arrival rate (divide timestamps) by this (default 1)")
    a("--event-lag-ms", type=float, default=0.0,
      help="delay from an engine iteration to its events reaching the index (default 0)")
    a("--event-path", choices=["wire", "direct"], default="wire",
      help="events through msgpack encode/decode (wire, default) or as structs (direct)")
    a("--block-size", type=positive_int, default=32,
      help="tokens per KV block on workers and index (default 32; trace ids are 512 tokens)")
    a("--max-num-batched-tokens", type=positive_int, default=8192,
      help="engine tokens per iteration (default 8192)")
    a("--timing", choices=list(TIMING_MODELS), default=DEFAULT_TIMING,
      help=f"the simulated engine's cost model (default {DEFAULT_TIMING}): paged is "
           "shared/calibration's fit with decode attention priced as a paged kernel measured "
           "on the H200 (workers.timing.H200_LLAMA_1B_PAGED); calibrated is the fit as it is, "
           "whose decode concatenated K/V every step (9x dearer a token of context)")
    a("--affinity-weight", type=positive_float, default=None,
      help="the affinity factor of every kvroute policy, variants included (default: each "
           "policy's own; kvroute's is the router's, 4); --timing calibrated "
           "--affinity-weight 1 reproduces the figures measured before the eighth session")
    a("--affinity-lead-blocks", type=positive_int, default=None,
      help="the affinity lead of every kvroute policy, variants included (default: each "
           "policy's own; kvroute's is the router's, 8)")
    a("--seed", type=int, default=0, help="seed of generators and policies (default 0)")
    a("--json", dest="json_path", metavar="OUT", help="write the results as JSON here")
    a("--plot-dir", metavar="DIR", help="write PNG plots here")
    a("--sensitivity", action="store_true",
      help="run at event lags 0, 10 ms, 100 ms, 1 s (ignores --event-lag-ms)")
    a("--per-worker", action="store_true",
      help="also print and save each policy's per-worker requests, TTFT and decode context")
    a("--no-progress", action="store_true", help="no progress bars")
    a("--live", metavar="URL", help="replay against a running router at URL instead")
    a("--model", default=None, help="live: the model name to send (default: none)")
    a("--concurrency", type=positive_int, default=512,
      help="live: requests in flight at most (default 512)")


def build_parser() -> argparse.ArgumentParser:
    """Return the standalone parser of ``python -m bench.replay``."""
    p = argparse.ArgumentParser(prog="python -m bench.replay",
                                description="Replay a trace over routing policies side by side.")
    _add_arguments(p)
    return p


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` (with its ``replay`` subcommand) to the ``kvroute`` command's subparsers.

    Returns:
        The ``bench replay`` parser; dispatch parsed arguments to :func:`run_bench`.
    """
    bench = subparsers.add_parser("bench", help="benchmarks: trace replay over routing policies")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    replay = bsub.add_parser("replay", help="replay a trace over policies side by side",
                             description=__doc__.split("\n\n")[0])
    _add_arguments(replay)
    return replay


def _workload(args: argparse.Namespace) -> tuple[list[Any], str]:
    from bench.workloads import GeneratorConfig, generate, load_trace, scale_rate

    if args.generator == "trace":
        path = Path(args.trace) if args.trace else _REPO / DEFAULT_TRACE
        requests = load_trace(path, limit=args.requests)
        name = path.name
    else:
        config = GeneratorConfig(requests=args.requests or 2000, rate=args.rate)
        requests = generate(args.generator, config, seed=args.seed)
        name = args.generator
    return scale_rate(requests, args.rate_scale), name


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, unit="req")


def _policies(args: argparse.Namespace) -> list[Any]:
    """Fresh policies for ``--policies``, with ``--affinity-weight`` and
    ``--affinity-lead-blocks`` applied to kvroute's."""
    from bench.policies import KvroutePolicy, make_policies

    changes = {k: v for k, v in (("affinity_weight", args.affinity_weight),
                                 ("affinity_lead_blocks", args.affinity_lead_blocks))
               if v is not None}
    policies = make_policies(args.policies)
    for p in policies:
        if changes and isinstance(p, KvroutePolicy):
            p.config = dataclasses.replace(p.config, **changes)
    return policies


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed arguments describe; return the exit status.

    Returns:
        0 on success, 2 on a bad setting (the message goes to stderr).
    """
    from bench.bounds import compute_bounds
    from bench.policies import make_policies
    from bench.report import per_worker, per_worker_table, plot, summarize, table, write_json
    from bench.sim import SimConfig, simulate

    try:
        requests, name = _workload(args)
        if args.live and args.per_worker:
            raise ValueError("--per-worker reports the simulation's workers; a --live run "
                             "sees only the router")
        if not args.live:
            make_policies(args.policies)  # fail fast on a bad name
        lags = SENSITIVITY_LAGS_MS if args.sensitivity else (args.event_lag_ms,)
        configs = [SimConfig(workers=args.workers, capacity_tokens=args.capacity_tokens,
                             block_size=args.block_size, event_lag_s=lag / 1e3,
                             event_path=args.event_path,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             timing=TIMING_MODELS[args.timing])
                   for lag in lags]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print("error: the workload has no requests", file=sys.stderr)
        return 2
    show = not args.no_progress
    started = time.perf_counter()
    bounds = compute_bounds(requests, args.block_size, args.workers, configs[0].num_blocks)
    bounds_s = time.perf_counter() - started
    print(f"workload {name}: {len(requests)} requests over "
          f"{requests[-1].arrival_s - requests[0].arrival_s:.1f} s, "
          f"{bounds.prompt_tokens:,} prompt tokens; bounds: unlimited {bounds.unlimited:.1%}, "
          f"pooled LRU ({args.workers} x {args.capacity_tokens:,} tokens) "
          f"{bounds.pooled_lru:.1%} [{bounds_s:.1f} s]", file=sys.stderr)
    if args.live:
        from bench.live import run_live

        return run_live(args, requests, name, bounds)
    document: dict[str, Any] = {
        "workload": name,
        "settings": {k: v for k, v in vars(args).items() if not callable(v)},
        "requests": len(requests),
        "bounds": dataclasses.asdict(bounds),
        "runs": [],
    }
    for config in configs:
        results, rows = [], []
        for policy in _policies(args):
            bar = _progress(len(requests), f"{policy.name} lag {config.event_lag_s * 1e3:g} ms",
                            show)
            try:
                res = simulate(requests, policy, config, seed=args.seed, progress=bar)
            finally:
                if bar is not None:
                    bar.close()
            results.append(res)
            rows.append(summarize(res, bounds))
            if args.per_worker:
                rows[-1]["per_worker"] = per_worker(res)
        title = (f"{name}, {args.workers} workers x {args.capacity_tokens:,} tokens, rate x"
                 f"{args.rate_scale:g}, event lag {config.event_lag_s * 1e3:g} ms, "
                 f"block {args.block_size}")
        print(table(rows, title))
        print()
        for row in rows if args.per_worker else ():
            print(per_worker_table(row["per_worker"], f"{row['policy']}, per worker"))
            print()
        run = {"event_lag_ms": config.event_lag_s * 1e3, "rows": rows, "plots": []}
        if args.plot_dir:
            tag = f"_lag{config.event_lag_s * 1e3:g}ms" if args.sensitivity else ""
            ttfts = {res.policy: [r.ttft_s for r in res.records] for res in results}
            run["plots"] = [str(p) for p in plot(args.plot_dir, ttfts, rows, bounds, tag)]
        document["runs"].append(run)
    if args.json_path:
        write_json(args.json_path, document)
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.replay``."""
    return run_bench(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
