"""Worker settings compared over one fleet each: several replays per fleet, configs in turn.

Run (on a GPU machine, from the repository root)::

    python -m bench.gpu.fleet_runs --cold-rate 180000 \\
        --configs 'fcfs=;short=--short-prefill 2048 --short-pass-tokens 2048' \\
        --runs trace:0:100@0.3,trace:0:150@1.5,long_context:2:60@0.3,long_context:2:120@1.5 \\
        --json bench-out/fleet_runs.json

A fleet (:class:`bench.gpu_routing.Fleet`: ``--workers`` torch workers on the one device, CUDA
MPS as ``--mps`` says, the real router with policy ``--policy``) starts once per config; the
config's flags are :mod:`bench.gpu_routing`'s (``--short-prefill``,
``--max-num-batched-tokens``, ...), after the common ones given after ``--``. Starting a fleet
of four llama-1b workers takes most of a minute, so one fleet serves every run of its config:
each run empties every worker's prefix cache first (as a capacity probe does) and replays its
workload, so it starts as cold as on a fresh fleet, with the kernels and plans already built.

A run ``WORKLOAD:SEED_OR_FIRST:COUNT@LOAD`` is the Mooncake trace's window ``FIRST ..
FIRST + COUNT`` (``trace``) or COUNT requests of a generator (``long_context``, ...) of seed
SEED, arrivals compressed to ``LOAD x --cold-rate`` prompt tokens/s. Before its runs each fleet
times, per workload, the median prompt prefilled alone: a fresh prompt of that many tokens sent
straight to one worker with the fleet idle (``max_tokens`` 1, over HTTP, median of
``--isolated-repeats``): the reference for the TTFT target (TTFT p50 at most 4x it).

``--routers 'kv=;nofetch=--kv-fetch off;rr=--policy round_robin'`` replays every run under
each router setting in turn over the same fleet: the router (flags after ``--policy``'s, so a
later ``--policy`` wins) is replaced before each replay, the workers kept, their caches emptied
as for any run. With ``--kv-transfer-secret-file`` among the common flags the router and every
worker share the secret, so co-located torch workers copy fetched blocks over CUDA IPC.

``--repeats N`` replays every (run, router) pair N times, the routers' order rotated each
repeat and run (:func:`schedule`), and prints each pair's median TTFT p50; ``--warmup RUN``
gives each fresh fleet one unmeasured replay first. Without them, the first router listed is
always the first to meet each run, and its first run meets the fleet's first traffic.

Printed per run: the row of :mod:`bench.gpu_routing` (TTFT p50 / p90 / p99, prompt tokens/s
over the makespan, hit, errors) and TTFT p50 over the isolated prefill,
the router's peer fetches (fetched / failed, GB) and the workers' fetches by transfer (HTTP,
CUDA IPC); in the JSON also every
worker's ``/metrics`` after the run. ``--stop-after`` bounds the whole (no fleet starts and
no run begins past it), for a device lease.

What it measured on one H200 (``docs/gpu.md``, the packaged trace and a held-out conversation
window): the trace's window saturates four workers at 80k prompt tok/s, device-bound, and
``--short-prefill 2048`` cuts its median TTFT at saturation from 4.0 s to 1.3-2.0 s, but costs
the conversation window 16% of its 156k prompt tok/s; the workers' default stays first come,
first served. With ``--routers`` over the same windows (kv with fetch, without, round-robin):
kv 8.8x round-robin at TTFT p50 on the conversations at load 0.6 and 2.8x at 0.3, fetch
within the spread of none; on the trace's cold window (hit 1-5%) fetch all but idle and the
three settings within one another's spread once warmed and rotated (an unrotated first run
had put kv at 2x the others).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu.mps import Mps
from bench.gpu_routing import Fleet, build_parser, post_json, window, worker_urls
from bench.workloads import DEFAULT_TRACE, GeneratorConfig, WorkloadRequest, generate, scale_rate

__all__ = ["RunSpec", "isolated_prefill_s", "main", "parse_configs", "parse_runs", "schedule",
           "workload"]


@dataclass(frozen=True)
class RunSpec:
    """One replay: a workload (``trace`` or a generator), its seed (a trace: first request),
    its request count and the load it is offered at."""

    workload: str
    seed: int
    count: int
    load: float

    @property
    def key(self) -> tuple[str, int, int]:
        return self.workload, self.seed, self.count


def parse_runs(text: str) -> list[RunSpec]:
    """``W:S:N@L,...`` as :class:`RunSpec` values.

    Raises:
        ValueError: a malformed entry, a count under 1 or a load that is not positive.
    """
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            head, load = item.split("@")
            name, seed, count = head.split(":")
            spec = RunSpec(name, int(seed), int(count), float(load))
        except ValueError:
            raise ValueError(f"run {item!r} is not WORKLOAD:SEED:COUNT@LOAD") from None
        if spec.count < 1 or not spec.load > 0:
            raise ValueError(f"run {item!r}: COUNT must be at least 1 and LOAD positive")
        out.append(spec)
    if not out:
        raise ValueError("no runs given")
    return out


def parse_configs(text: str) -> list[tuple[str, list[str]]]:
    """``NAME=FLAGS;...`` as (name, flags) pairs, flags split as a shell would.

    Raises:
        ValueError: an entry without ``=`` or a repeated name.
    """
    out: list[tuple[str, list[str]]] = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, sep, flags = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"config {item!r} is not NAME=FLAGS")
        if name.strip() in {n for n, _ in out}:
            raise ValueError(f"config {name.strip()!r} is named twice")
        out.append((name.strip(), shlex.split(flags)))
    if not out:
        raise ValueError("no configs given")
    return out


def schedule(runs: Sequence[RunSpec], routers: Sequence[tuple[str, list[str]]],
             repeats: int) -> list[tuple[int, RunSpec, tuple[str, list[str]]]]:
    """The replays of one fleet in order: per repeat, every run under every router, the
    routers' order rotated by one each repeat (and each run), so no setting is always the
    first to meet a freshly emptied fleet or the one after a given other.

    Returns (repeat, run, router) triples.
    """
    out = []
    for rep in range(repeats):
        for i, spec in enumerate(runs):
            shift = (rep + i) % len(routers)
            for router in [*routers[shift:], *routers[:shift]]:
                out.append((rep, spec, router))
    return out


def workload(spec: RunSpec, max_model_len: int) -> list[WorkloadRequest]:
    """The requests of ``spec``, unscaled (at most ``max_model_len`` with the reply)."""
    if spec.workload == "trace":
        return window(DEFAULT_TRACE, spec.seed, spec.count, max_model_len)[0]
    rows = generate(spec.workload, GeneratorConfig(requests=spec.count, rate=1.0), spec.seed)
    return [r for r in rows if r.input_length + r.output_length <= max_model_len]


def isolated_prefill_s(url: str, tokens: int, repeats: int, salt: int) -> float:
    """Median seconds of a fresh ``tokens``-token prompt sent alone to the worker at ``url``
    (one output token); the worker's cache is emptied after."""
    times = []
    for r in range(repeats):
        prompt = [4 + (salt * 104729 + r * 7919 + j * 31337) % 256 for j in range(tokens)]
        started = time.perf_counter()
        post_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 1}, 300)
        times.append(time.perf_counter() - started)
    post_json(f"{url}/reset_prefix_cache", {}, 30)
    return statistics.median(times)


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return resp.read().decode()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m bench.gpu.fleet_runs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="default=", help="NAME=FLAGS;... (default: one, as is)")
    p.add_argument("--runs", required=True, help="WORKLOAD:SEED:COUNT@LOAD,...")
    p.add_argument("--cold-rate", type=float, default=180_000.0)
    p.add_argument("--policy", default="kv")
    p.add_argument("--routers", default=None,
                   help="NAME=ROUTER_FLAGS;...: every run under each router setting in turn, "
                   "the router replaced between them (default: one, --policy as is)")
    p.add_argument("--isolated-repeats", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1,
                   help="replay every (run, router) this many times, router order rotated "
                   "(default 1); the summary prints each pair's median")
    p.add_argument("--warmup", default=None, metavar="RUN",
                   help="one unmeasured replay (WORKLOAD:SEED:COUNT@LOAD) on each fresh fleet "
                   "before the measured ones, so the first measured replay does not meet the "
                   "fleet's first traffic")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no fleet and no run once this long has passed since the start")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(own)
    started = time.monotonic()

    def late() -> bool:
        return args.stop_after is not None and time.monotonic() - started > args.stop_after

    try:
        runs, configs = parse_runs(args.runs), parse_configs(args.configs)
        routers = parse_configs(args.routers) if args.routers else [(args.policy, [])]
        warm = parse_runs(args.warmup)[0] if args.warmup else None
        if args.repeats < 1:
            raise ValueError("--repeats must be at least 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = build_parser().parse_args(["--cold-rate", str(args.cold_rate), *common])
    loads = {spec.key: workload(spec, base.max_model_len) for spec in runs}
    if warm is not None:
        loads.setdefault(warm.key, workload(warm, base.max_model_len))
    result: dict[str, Any] = {"cold_rate": args.cold_rate, "policy": args.policy,
                              "common": common, "configs": []}
    errors = 0
    with Mps(base.mps) as mps:
        print(f"# CUDA MPS: {mps.status}", flush=True)
        result["mps"] = mps.status
        for name, flags in configs:
            if late():
                print(f"# {name}: not run (--stop-after)", flush=True)
                continue
            fargs = build_parser().parse_args(["--cold-rate", str(args.cold_rate), *common,
                                               *flags])
            entry: dict[str, Any] = {"name": name, "flags": flags, "isolated_s": {}, "runs": []}
            result["configs"].append(entry)
            with Fleet(fargs, args.policy, fargs.log_dir) as fleet:
                entry["ready_s"] = fleet.ready_s
                urls = worker_urls(fleet.cluster)
                for i, (key, reqs) in enumerate(loads.items()):
                    median = round(statistics.median(r.input_length for r in reqs))
                    entry["isolated_s"][":".join(map(str, key))] = {
                        "tokens": median,
                        "seconds": isolated_prefill_s(urls[0], median, args.isolated_repeats, i)}
                print(f"# {name}: ready in {fleet.ready_s:.1f} s; isolated "
                      f"{json.dumps(entry['isolated_s'])}", flush=True)
                routed: list[str] = []  # the fleet starts with --policy, no flags
                if warm is not None:
                    fleet.reset()
                    row = fleet.replay(_scaled(loads[warm.key], warm, args.cold_rate))
                    print(f"# {name}: warm-up {warm} done, {row['errors']} errors", flush=True)
                for rep, spec, (router, rflags) in schedule(runs, routers, args.repeats):
                    if late():
                        print(f"# {name}: {spec} {router} not run (--stop-after)", flush=True)
                        continue
                    scaled = _scaled(loads[spec.key], spec, args.cold_rate)
                    if routed != rflags:
                        fleet.reroute(args.policy, rflags)
                        routed = rflags
                    fleet.reset()
                    row = fleet.replay(scaled)
                    iso = entry["isolated_s"][":".join(map(str, spec.key))]["seconds"]
                    row.update(config=name, router=router, repeat=rep,
                               workload=spec.workload, seed=spec.seed,
                               count=spec.count, load=spec.load,
                               arrival_span_s=scaled[-1].arrival_s,
                               ttft_over_isolated=row["ttft_p50_s"] / iso if iso else 0.0,
                               metrics=[_metrics(u) for u in urls])
                    errors += row["errors"]
                    entry["runs"].append(row)
                    print(_line(row), flush=True)
                    if args.json_path:
                        _write(args.json_path, result)
    print("config        router    workload        load  hit     TTFT p50    p90    p99  "
          "x isolated  prompt tok/s  out tok/s  err  fetched/failed    GB  http/ipc")
    for entry in result["configs"]:
        for row in entry["runs"]:
            print(_line(row))
    if args.repeats > 1:
        print("median over repeats: config router workload load -> TTFT p50 (each repeat's)")
        for entry in result["configs"]:
            for pair, p50s in _p50s_by_pair(entry["runs"]).items():
                print(f"{entry['name']:<13} {pair}  {statistics.median(p50s):.3f}  "
                      f"({' '.join(f'{v:.3f}' for v in p50s)})")
    if args.json_path:
        _write(args.json_path, result)
    return 0 if errors == 0 else 1


def _scaled(reqs: list[WorkloadRequest], spec: RunSpec, cold_rate: float) -> list[WorkloadRequest]:
    tokens = sum(r.input_length for r in reqs)
    span = reqs[-1].arrival_s or 1.0
    return scale_rate(reqs, span / (tokens / (spec.load * cold_rate)))


def _p50s_by_pair(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in rows:
        run = f"{row['workload']}:{row['seed']}:{row['count']}@{row['load']:g}"
        key = f"{row.get('router', ''):<9} {run}"
        out.setdefault(key, []).append(row["ttft_p50_s"])
    return out


def _line(row: dict[str, Any]) -> str:
    source = f"{row['workload']}:{row['seed']}:{row['count']}"
    f = row.get("fetch", {})
    return (f"{row['config']:<13} {row.get('router', ''):<9} {source:<15} {row['load']:>4g} "
            f"{row['hit_rate']:>6.1%} "
            f"{row['ttft_p50_s']:>8.3f} {row['ttft_p90_s']:>6.3f} {row['ttft_p99_s']:>6.3f} "
            f"{row['ttft_over_isolated']:>10.2f}  {row['prompt_tok_s']:>12,.0f} "
            f"{row['output_tok_s']:>10,.0f} {row['errors']:>4}  "
            f"{f.get('router_fetched', 0):>7.0f}/{f.get('router_failed', 0):<6.0f} "
            f"{f.get('router_bytes', 0) / 1e9:>5.2f}  "
            f"{f.get('worker_http', 0):.0f}/{f.get('worker_cuda_ipc', 0):.0f}")


def _write(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
