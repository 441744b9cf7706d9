"""Trace replay: every policy over the same workload on a simulated cluster, side by side.

``python -m bench.replay --trace FILE --workers 8 --policies all --json OUT`` (also
``kvroute bench replay``, through :mod:`bench.cli`). Each policy
runs on a fresh simulated cluster (:mod:`bench.sim`) in virtual time; the bounds
(:mod:`bench.bounds`) are computed once per workload. Prints a table, writes JSON (with
``--json``) and PNG plots (with ``--plot-dir``). ``--sensitivity`` repeats the run at event
lags of 0, 10 ms, 100 ms and 1 s. ``--live URL`` replays against a running router instead
(:mod:`bench.live`). ``--per-worker`` adds each policy's per-worker table (requests, TTFT,
decode context: where a skewed median comes from) to the terminal and the JSON.

Every run with ``kvroute`` and a peer policy in it also gets the targets checked
(:mod:`bench.targets`): a line under its table and ``targets`` in its JSON. ``--seeds 0-9``
repeats the whole run at each seed (generators draw a new workload per seed; the trace is the
same, the policies' and engines' randomness is not) and ends with the tally over all runs;
``--topologies 4,1p3d,2p2d --rate-scales 0.5,1,1.5`` compares worker topologies, disaggregated
prefill and decode against aggregated workers, at several loads (:mod:`bench.topology`);
``--live-topologies 4,1p3d,2p2d`` does the same on real ``kvroute worker`` processes behind a
``kvroute router``, started and stopped per run (:mod:`bench.topology_live`).
``--jobs N`` runs the simulations in N processes (each one's figures are the same as in one
process: a simulation is seeded and in virtual time).

Settings are read here once and passed down frozen.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.replay_setup import (
    build_policies,
    build_sim_config,
    build_workload,
    parse_router_changes,
)
from kvroute.argtypes import positive_float, positive_int, seed_list
from workers.engine.timing import DEFAULT_TIMING, TIMING_MODELS

__all__ = ["build_parser", "main", "run_bench"]

#: The default trace, relative to the repository root.
SENSITIVITY_LAGS_MS = (0.0, 10.0, 100.0, 1000.0)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--trace", help="Mooncake JSONL trace (default: the Mooncake trace in bench/data)")
    a("--generator", default="trace",
      choices=["trace", "system_prompt", "multi_turn", "agentic", "images", "long_context"],
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
      help=f"the simulated engine's cost model (default {DEFAULT_TIMING}): measured is "
           "bench/data's H200 calibration fit with attention over cached K/V (decode, and "
           "prefill over a cached prefix) priced as kernels measured on the H200 "
           "(workers.engine.timing.H200_LLAMA_1B_MEASURED); paged prices only decode so; "
           "calibrated is the fit as it is, whose decode concatenated K/V "
           "every step (9x dearer a token of context)")
    a("--set", dest="router_settings", action="append", default=[], metavar="NAME=VALUE",
      help="a router setting for every kvroute policy in the run, as the router's flag "
           "--NAME takes it (repeatable; e.g. --set learn_rates=off --set sessions=off)")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=0,
                       help="seed of generators and policies (default 0)")
    seeds.add_argument("--seeds", type=seed_list, default=None, metavar="SEEDS",
                       help="run once per seed (0-9, 0,3,5 or 0-4,9) and tally the targets "
                            "over all runs")
    a("--jobs", type=positive_int, default=1,
      help="simulations run in this many processes at once (default 1)")
    a("--slo", type=positive_float, default=None, metavar="SECONDS",
      help="capacity mode: per policy, the highest --rate-scale in --capacity-range whose TTFT "
      "p99 stays under SECONDS (bisection; bench.capacity), goodput there, kv over round-robin")
    a("--capacity-range", default="0.25,4", metavar="LO,HI",
      help="capacity mode: the rate scales searched (default 0.25,4)")
    a("--capacity-steps", type=int, default=6, help="capacity mode: bisection steps (default 6)")
    a("--topologies", metavar="SPECS",
      help="topology mode: compare worker topologies, comma-separated: N aggregated workers "
           "or PpDd (P prefill, D decode workers), e.g. 4,1p3d,2p2d (bench.topology)")
    a("--rate-scales", metavar="SCALES",
      help="topology mode: the loads, comma-separated rate scales (default --rate-scale)")
    a("--live-topologies", metavar="SPECS",
      help="live topology mode: per topology (as --topologies) start that many kvroute "
           "workers (sim engine, real time) and a router with their roles, replay, stop "
           "them; TTFT, inter-token latency and throughput side by side (bench.topology_live)")
    a("--live-local-prefill", default="0,256", metavar="TOKENS",
      help="live topology mode: the router's --pd-local-prefill-tokens values each PpDd "
           "topology runs with (default 0,256: every prefill remote, and selective)")
    a("--speedup", type=positive_float, default=0.1,
      help="live topology mode: the workers' --speedup; arrivals come at this times the rate "
           "and times reported in engine seconds (default 0.1)")
    a("--repeats", type=positive_int, default=1,
      help="live topology mode: runs of every topology per load, alternated (default 1)")
    a("--base-port", type=positive_int, default=None, metavar="PORT",
      help="live topology mode: the router's port; workers at PORT+1.., their event streams "
           "at PORT+101.. and PORT+201.. (default: free ports)")
    a("--fleet-nice", type=int, default=5,
      help="live topology mode: the fleet's processes run under nice -n this (default 5)")
    a("--ready-timeout", type=positive_float, default=60.0,
      help="live topology mode: seconds a process has to answer its health check "
           "(default 60)")
    a("--kv-transfer-bandwidth", type=positive_float, default=25e9, metavar="BYTES_PER_S",
      help="disaggregated serving: the prefill-to-decode KV link; peer fetch: the link "
           "between workers (default 25e9)")
    a("--peer-fetch", action="store_true",
      help="every simulated worker serves and receives peer KV fetches, as a kvroute "
           "worker's /model_info advertises them (kvroute then may fetch; --set "
           "kv_fetch=off turns the rule's fetch off)")
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


def build_parser(prog: str = "python -m bench.replay") -> argparse.ArgumentParser:
    """Return the parser of ``python -m bench.replay`` (``kvroute bench replay`` as ``prog``)."""
    p = argparse.ArgumentParser(prog=prog,
                                description="Replay a trace over routing policies side by side.")
    _add_arguments(p)
    return p


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, unit="req")


def _simulate_one(args: argparse.Namespace, seed: int, lag_ms: float, policy_name: str,
                  bounds: Any, bar: Any = None, requests: list[Any] | None = None
                  ) -> tuple[dict[str, Any], list[float]]:
    """Simulate one policy on one seed's workload at one lag; return its row and TTFTs.

    The same code runs in this process and in ``--jobs`` worker processes (which build the
    workload themselves when ``requests`` is not given), so both give the same figures."""
    from bench.report import per_worker, summarize
    from bench.sim import simulate

    if requests is None:
        requests, _ = build_workload(args, seed)
    (policy,) = build_policies(args, policy_name)
    res = simulate(requests, policy, build_sim_config(args, lag_ms), seed=seed, progress=bar)
    row = summarize(res, bounds)
    if args.per_worker:
        row["per_worker"] = per_worker(res)
    return row, [r.ttft_s for r in res.records]


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed arguments describe; return the exit status.

    Returns:
        0 on success, 2 on a bad setting (the message goes to stderr).
    """
    from bench.bounds import compute_bounds
    from bench.policies import make_policies
    from bench.report import per_worker_table, plot, table, write_json
    from bench.targets import describe, summary_line, tally, verdict

    if args.live_topologies:
        from bench.topology_live import run_live_topologies

        return run_live_topologies(args)
    if args.topologies and not args.live:
        from bench.topology import run_topologies

        return run_topologies(args)
    if args.slo is not None and not args.live:
        from bench.capacity import run_replay_capacity

        return run_replay_capacity(args)
    seeds = args.seeds if args.seeds is not None else [args.seed]
    try:
        if args.live and args.per_worker:
            raise ValueError("--per-worker reports the simulation's workers; a --live run "
                             "sees only the router")
        if args.live and (len(seeds) > 1 or args.jobs > 1):
            raise ValueError("--seeds and --jobs are for simulations; a --live run replays "
                             "one workload against one router")
        if not args.live:
            names = [p.name for p in make_policies(args.policies)]  # fail fast on a bad name
            parse_router_changes(args.router_settings)
        lags = SENSITIVITY_LAGS_MS if args.sensitivity else (args.event_lag_ms,)
        for lag in lags:
            build_sim_config(args, lag)  # a bad setting fails here, before any simulation
        if args.generator == "trace":  # the same requests at every seed: load them once
            workloads = [build_workload(args, seeds[0])] * len(seeds)
        else:
            workloads = [build_workload(args, seed) for seed in seeds]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not workloads[0][0]:
        print("error: the workload has no requests", file=sys.stderr)
        return 2
    show = not args.no_progress
    num_blocks = build_sim_config(args, lags[0]).num_blocks
    all_bounds = []
    for i, (seed, (requests, name)) in enumerate(zip(seeds, workloads, strict=True)):
        if i and requests is workloads[i - 1][0]:
            all_bounds.append(all_bounds[-1])
            continue
        started = time.perf_counter()
        bounds = compute_bounds(requests, args.block_size, args.workers, num_blocks)
        all_bounds.append(bounds)
        print(f"workload {name}{f' seed {seed}' if len(seeds) > 1 else ''}: {len(requests)} "
              f"requests over {requests[-1].arrival_s - requests[0].arrival_s:.1f} s, "
              f"{bounds.prompt_tokens:,} prompt tokens; bounds: unlimited "
              f"{bounds.unlimited:.1%}, pooled LRU ({args.workers} x {args.capacity_tokens:,} "
              f"tokens) {bounds.pooled_lru:.1%} [{time.perf_counter() - started:.1f} s]",
              file=sys.stderr)
    if args.live:
        from bench.live import run_live

        return run_live(args, workloads[0][0], workloads[0][1], all_bounds[0])
    name = workloads[0][1]
    document: dict[str, Any] = {
        "workload": name,
        "settings": {k: v for k, v in vars(args).items() if not callable(v)},
        "requests": len(workloads[0][0]),
        "bounds": dataclasses.asdict(all_bounds[0]),
        "runs": [],
    }
    specs = [(seed, i, lag, policy) for i, seed in enumerate(seeds) for lag in lags
             for policy in names]
    outcomes = _run_specs(args, specs, workloads, all_bounds, show)
    verdicts = []
    for i, seed in enumerate(seeds):
        for lag in lags:
            rows = [outcomes[(seed, lag, policy)][0] for policy in names]
            title = (f"{name}, {args.workers} workers x {args.capacity_tokens:,} tokens, rate x"
                     f"{args.rate_scale:g}, event lag {lag:g} ms, block {args.block_size}"
                     f"{f', seed {seed}' if len(seeds) > 1 else ''}")
            print(table(rows, title))
            target = verdict(rows)
            verdicts.append(target)
            if target is not None:
                print(describe(target))
            print()
            for row in rows if args.per_worker else ():
                print(per_worker_table(row["per_worker"], f"{row['policy']}, per worker"))
                print()
            run = {"seed": seed, "event_lag_ms": lag, "rows": rows, "plots": [],
                   "bounds": dataclasses.asdict(all_bounds[i]), "targets": target}
            if args.plot_dir:
                tag = f"_lag{lag:g}ms" if args.sensitivity else ""
                tag += f"_seed{seed}" if len(seeds) > 1 else ""
                ttfts = {row["policy"]: outcomes[(seed, lag, row["policy"])][1]
                         for row in rows}
                run["plots"] = [str(p) for p in plot(args.plot_dir, ttfts, rows,
                                                     all_bounds[i], tag)]
            document["runs"].append(run)
    if len(verdicts) > 1 and any(v is not None for v in verdicts):
        counts = tally(verdicts)
        document["targets"] = counts
        print(summary_line(counts))
    if args.json_path:
        write_json(args.json_path, document)
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0


def _run_specs(args: argparse.Namespace, specs: list[tuple[int, int, float, str]],
               workloads: list[tuple[list[Any], str]], all_bounds: list[Any], show: bool
               ) -> dict[tuple[int, float, str], tuple[dict[str, Any], list[float]]]:
    """Simulate every (seed, lag, policy): in this process with a progress bar per
    simulation, or with ``--jobs`` > 1 in that many processes with one bar over all."""
    out: dict[tuple[int, float, str], tuple[dict[str, Any], list[float]]] = {}
    if args.jobs == 1 or len(specs) == 1:
        for seed, i, lag, policy in specs:
            requests = workloads[i][0]
            bar = _progress(len(requests), f"{policy} lag {lag:g} ms"
                            f"{f' seed {seed}' if args.seeds else ''}", show)
            try:
                out[(seed, lag, policy)] = _simulate_one(args, seed, lag, policy,
                                                         all_bounds[i], bar, requests)
            finally:
                if bar is not None:
                    bar.close()
        return out
    from concurrent.futures import ProcessPoolExecutor, as_completed

    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc=f"simulations, {args.jobs} at once", file=sys.stderr,
                   leave=False, unit="sim")
    try:
        with ProcessPoolExecutor(min(args.jobs, len(specs))) as pool:
            futures = {pool.submit(_simulate_one, args, seed, lag, policy, all_bounds[i]):
                       (seed, lag, policy) for seed, i, lag, policy in specs}
            for future in as_completed(futures):
                out[futures[future]] = future.result()
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.replay``."""
    return run_bench(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
