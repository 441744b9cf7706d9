"""Worker topologies live: disaggregated prefill and decode against aggregated workers, on real
processes (``python -m bench.replay --live-topologies 4,1p3d,2p2d``).

``python -m bench.replay --live-topologies 4,1p3d,2p2d --rate-scales 5,20,30 --generator
system_prompt --requests 200 --speedup 0.1 --repeats 2`` runs, per load, repeat and
topology, a fresh fleet: one ``kvroute worker`` process per worker of the topology (the sim
engine in real time, each forward pass lasting the timing model's seconds divided by
``--speedup``; below 1 the engine is slower than the model, so that the client, router and
workers keep up on a small machine) and a ``kvroute router`` with ``--worker
URL,role=prefill|decode`` for each. A ``PpDd`` topology runs once per value of
``--live-local-prefill`` (the router's ``--pd-local-prefill-tokens``: 0 sends every prefill to
a prefill worker, 256 is the router's default, selective disaggregation). The workload is
replayed at its arrival times (:func:`bench.live.replay_live`: open loop, streaming, TTFT from
the scheduled arrival, every gap between two streamed tokens an inter-token latency).

Loads and times are in the engine's seconds, as :mod:`bench.topology` (the simulation) reports
them: ``--rate-scales`` are the simulation's, the arrivals come at ``--speedup`` times the
rate, and every wall time is multiplied by ``--speedup`` (output tokens a second divided by
it). So a row reads beside the simulation's at the same rate scale, and what the live run adds
is the real router, HTTP, event streams and transfers, whose own wall time shrinks by the same
factor. The topologies alternate within each repeat, so a drift of the machine's load falls on
all of them; the load average when each run ended is in its row (the client, router and
workers share the machine).

Each process runs under ``nice -n --fleet-nice`` (default 5), is waited for with a bound, and
is stopped when its run ends, fails or is interrupted (Ctrl-C or SIGTERM). Ports are free ones
unless ``--base-port P`` is given: the router at P, worker i at P+1+i, its event streams at
P+101+i and P+201+i.

What it found (``docs/benchmarks.md``, "Live, on real processes", has the table): at speedup 0.1
on a shared 2-core machine a run of 200 requests takes 30-50 s and the live rows track the
simulation's. Aggregated workers keep the lowest TTFT and the worst ITL tail (p99 30-39 ms,
the simulation's within 3 ms); 1p3d and 2p2d keep ITL p99 at 9-18 ms with their prefill side
saturated from rate x20 (TTFT p50 about 1 s and 410-520 ms). A remote prefill costs 20-90
engine ms of TTFT more than simulated, 165 in one case (its HTTP round trip and the KV
pull); the router's default ``--pd-local-prefill-tokens`` 256 lowered TTFT p50 against 0 in
every pair of runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import signal
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bench.topology import parse_topology, topology_table

__all__ = ["FleetPlan", "engine_row", "plan_fleet", "remote_share", "run_live_topologies"]


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """The processes of one run: each worker's ``kvroute`` arguments and URL, the router's."""

    workers: tuple[tuple[str, ...], ...]
    worker_urls: tuple[str, ...]
    router: tuple[str, ...]
    router_url: str


def plan_fleet(roles: Sequence[str], args: argparse.Namespace, local_prefill: int | None,
               ports: Sequence[int]) -> FleetPlan:
    """The commands of one fleet: ``ports`` are the router's, then per worker its HTTP,
    events and replay ports (``1 + 3 * len(roles)`` of them); ``local_prefill`` is the
    router's ``--pd-local-prefill-tokens`` (None: its default)."""
    from workers.engine.timing import TIMING_MODELS

    if len(ports) != 1 + 3 * len(roles):
        raise ValueError(f"{len(roles)} workers need {1 + 3 * len(roles)} ports")
    speedup = args.speedup
    kv_bytes = str(TIMING_MODELS[args.timing].kv_bytes_per_token)  # the simulation's
    workers, urls = [], []
    router = ["router", "--port", str(ports[0]), "--block-size", str(args.block_size),
              "--pd-kv-bytes-per-token", kv_bytes,
              "--pd-transfer-bandwidth", str(args.kv_transfer_bandwidth * speedup)]
    if local_prefill is not None:
        router += ["--pd-local-prefill-tokens", str(local_prefill)]
    for i, role in enumerate(roles):
        http, events, replay = ports[1 + 3 * i: 4 + 3 * i]
        workers.append(("worker", "--port", str(http), "--events-port", str(events),
                        "--replay-port", str(replay), "--speedup", str(speedup),
                        "--timing", args.timing, "--block-size", str(args.block_size),
                        "--num-blocks", str(args.capacity_tokens // args.block_size),
                        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                        "--kv-bytes-per-token", kv_bytes,
                        "--kv-transfer-bandwidth", str(args.kv_transfer_bandwidth)))
        url = f"http://127.0.0.1:{http}"
        urls.append(url)
        # a kvroute worker names its own event streams at /model_info
        router += ["--worker", url if role == "both" else f"{url},role={role}"]
    return FleetPlan(tuple(workers), tuple(urls), tuple(router), f"http://127.0.0.1:{ports[0]}")


def _ports(args: argparse.Namespace, workers: int) -> list[int]:
    from kvroute.up import free_port

    if args.base_port is None:
        return [free_port() for _ in range(1 + 3 * workers)]
    base = args.base_port
    out = [base]
    for i in range(workers):
        out += [base + 1 + i, base + 101 + i, base + 201 + i]
    return out


@contextlib.contextmanager
def _fleet(plan: FleetPlan, niceness: int, timeout: float) -> Iterator[str]:
    """Start the plan's workers (all at once), then its router; yield the router's URL; stop
    them all."""
    from bench.http_load import launch, spawn, stop, wait_ready

    procs: list[Any] = []
    try:
        for worker in plan.workers:
            procs.append(launch(list(worker), niceness))
        for proc, worker, url in zip(procs, plan.workers, plan.worker_urls, strict=True):
            wait_ready(proc, f"{url}/health", f"kvroute {' '.join(worker)}", timeout)
        procs.append(spawn(list(plan.router), plan.router_url, health="/ready",
                           timeout=timeout, niceness=niceness))
        yield plan.router_url
    finally:
        for proc in procs:
            stop(proc)


_REMOTE = re.compile(r'^kvroute_pd_prefills(?:_total)?\{outcome="(remote|local)"\}\s+(\S+)',
                     re.M)


def remote_share(metrics: str, requests: int) -> float:
    """The share of ``requests`` the router prefilled on a prefill worker, from its
    ``/metrics`` text (``kvroute_pd_prefills{outcome="remote"}``); NaN when it says none."""
    found = {k: float(v) for k, v in _REMOTE.findall(metrics)}
    if "remote" not in found or not requests:
        return math.nan
    return found["remote"] / requests


def engine_row(row: dict[str, Any], speedup: float) -> dict[str, Any]:
    """A live row's wall times in the engine's seconds (times ``speedup``), its output
    tokens per engine second (over ``speedup``)."""
    out = dict(row)
    for key, value in row.items():
        if key.endswith("_s") and key not in ("makespan_s", "wall_s") \
                and isinstance(value, float):
            out[key] = value * speedup
    out["output_tok_s"] = row["output_tok_s"] / speedup
    return out


def _one_run(args: argparse.Namespace, requests: Sequence[Any], topology: str,
             local_prefill: int | None) -> dict[str, Any]:
    from bench.live import replay_live, summarize_live

    roles = parse_topology(topology)
    plan = plan_fleet(roles, args, local_prefill, _ports(args, len(roles)))
    with _fleet(plan, args.fleet_nice, args.ready_timeout) as url:
        records, makespan = asyncio.run(replay_live(url, requests, concurrency=args.concurrency,
                                                    model=args.model))
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
                metrics = resp.read().decode()
        except OSError:
            metrics = ""
    row = engine_row(summarize_live(records, makespan), args.speedup)
    label = "kvroute" if local_prefill is None else f"local<={local_prefill}"
    row.update(topology=topology, policy=label, load_avg=os.getloadavg()[0],
               remote_prefill_share=remote_share(metrics, len(records)) if "p" in topology
               else 0.0)
    return row


def _variants(topologies: Sequence[str], local: Sequence[int]) -> list[tuple[str, int | None]]:
    """Each run of a repeat: an aggregated topology once, a split one per local threshold."""
    out: list[tuple[str, int | None]] = []
    for t in topologies:
        if "p" in t:
            out += [(t, n) for n in local]
        else:
            out.append((t, None))
    return out


_LIVE_COLUMNS = ("errors", "errors", "{}"), ("load_avg", "load", "{:.1f}")


def _table(rows: Sequence[dict[str, Any]], title: str) -> str:
    """The topology table with each run's failed requests and load average after it."""
    text = topology_table(rows, title).splitlines()
    extra = [[h for _, h, _ in _LIVE_COLUMNS]] + [
        [fmt.format(row[key]) for key, _, fmt in _LIVE_COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in extra) for i in range(len(_LIVE_COLUMNS))]
    out = [text[0]]
    for line, cells in zip(text[1:], extra, strict=True):
        out.append(line + "  " + "  ".join(c.rjust(w) for c, w in zip(cells, widths,
                                                                        strict=True)))
    return "\n".join(out)


def run_live_topologies(args: argparse.Namespace) -> int:
    """Run the live topology comparison (module docstring); return the exit status (2 on a
    bad setting, 1 when a run failed or a request did)."""
    from bench.replay_setup import build_workload
    from bench.report import write_json
    from bench.topology import replace_scale

    try:
        topologies = [t.strip() for t in args.live_topologies.split(",") if t.strip()]
        for t in topologies:
            parse_topology(t)
        scales = [float(s) for s in (args.rate_scales or str(args.rate_scale)).split(",")]
        local = [int(n) for n in args.live_local_prefill.split(",") if n.strip()]
        if not topologies or not scales or not all(s > 0 and math.isfinite(s) for s in scales):
            raise ValueError("--live-topologies needs a topology and --rate-scales positive "
                             "scales")
        if any(n < 0 for n in local) or not local:
            raise ValueError("--live-local-prefill needs token counts >= 0")
        if not args.speedup > 0 or args.repeats < 1:
            raise ValueError("--speedup must be positive and --repeats at least 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _interrupt)
    rows: list[dict[str, Any]] = []
    status = 0
    try:
        for scale in scales:
            requests, name = build_workload(replace_scale(args, scale * args.speedup), args.seed)
            for repeat in range(args.repeats):
                runs = _variants(topologies, local)
                if repeat % 2:  # alternate the order too, so no variant always runs first
                    runs.reverse()
                for topology, threshold in runs:
                    row = _one_run(args, requests, topology, threshold)
                    row.update(rate_scale=scale, repeat=repeat)
                    rows.append(row)
                    print(f"{name} x{scale:g} repeat {repeat + 1}: {topology} {row['policy']} "
                          f"TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms, ITL p99 "
                          f"{row['itl_p99_s'] * 1e3:.1f} ms, {row['errors']} failed, load "
                          f"{row['load_avg']:.1f}", file=sys.stderr)
                    if row["errors"]:
                        status = 1
            for repeat in range(args.repeats):
                ordered = sorted((r for r in rows if r["rate_scale"] == scale
                                  and r["repeat"] == repeat),
                                 key=lambda r: (topologies.index(r["topology"]), r["policy"]))
                print(_table(ordered, f"{name} live, rate x{scale:g} (engine seconds, speedup "
                                      f"{args.speedup:g}), {len(requests)} requests, "
                                      f"{args.capacity_tokens:,} tokens a worker, repeat "
                                      f"{repeat + 1}"))
                print()
    except (RuntimeError, KeyboardInterrupt) as exc:
        print(f"error: {str(exc) or 'interrupted'}; every process of the run was stopped",
              file=sys.stderr)
        status = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json_path:
        write_json(args.json_path, {"settings": {k: v for k, v in vars(args).items()
                                                 if not callable(v)}, "rows": rows})
        print(f"wrote {args.json_path}", file=sys.stderr)
    return status


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C, so the fleet is stopped on the way out."""
    raise KeyboardInterrupt
