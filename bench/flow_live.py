"""Flow control live: the real router in front of real simulated workers, flow control on and
off side by side, at fractions of the fleet's capacity (``python -m bench.flow --live``).

Per load and mode it starts ``--workers`` ``kvroute worker`` processes (the sim engine, each
iteration lasting the timing model's seconds divided by ``--speedup``: below 1, slower than
the model, so that a loaded machine keeps up) and a ``kvroute router`` in front of them, sends
:mod:`bench.flow`'s workload at its arrival times (:func:`bench.live.replay_live`: open loop,
streaming, TTFT from the scheduled arrival), each request with its priority in the body and
its tenant in ``x-kvroute-tenant``. A fresh cluster for each run, so no run inherits another's
cache. Times are reported in the engine's seconds (wall seconds times the speedup), so the
table reads as the simulation's: the same SLO, the same rates. The router's flags are the
simulation's, in wall seconds: the bound and the deadlines divided by the speedup.

Per run: goodput (requests per engine second of the arrival window whose TTFT met the SLO),
the share shed (429), the share failed otherwise (any other error: none expected), TTFT
p50/p99 per priority (served requests), Jain's index across tenants (as :mod:`bench.flow`),
and the machine's load average when the run ended (the client, router and workers share it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import Any

from bench.http_load import spawn, stop
from bench.live import LiveRecord, replay_live
from bench.workloads import WorkloadRequest, scale_rate
from kvroute.up import free_port

__all__ = ["run_live", "summarize_records"]


def summarize_records(records: Sequence[LiveRecord], tags: Mapping[str, tuple[int, str]],
                      slo_s: float, window_s: float, speedup: float) -> dict[str, Any]:
    """One live run's row (module docstring); ``window_s`` in wall seconds."""
    from bench.flow import fair_shares, jain, pct

    scale = speedup  # wall seconds to engine seconds
    good = shed = failed = 0
    offered: dict[str, float] = {}
    got: dict[str, float] = {}
    ttfts: dict[int, list[float]] = {}
    for rec in records:
        priority, tenant = tags.get(rec.request_id, (0, ""))
        offered[tenant] = offered.get(tenant, 0.0) + rec.prompt_tokens
        got.setdefault(tenant, 0.0)
        if rec.error is not None:
            if rec.error == "HTTP 429":
                shed += 1
            else:
                failed += 1
            continue
        ttft = rec.ttft_s * scale
        ttfts.setdefault(priority, []).append(ttft)
        if ttft <= slo_s:
            good += 1
            got[tenant] += rec.prompt_tokens
    n = max(len(records), 1)
    row: dict[str, Any] = {"goodput_rps": good / (window_s * scale), "shed": shed / n,
                           "failed": failed / n}
    for priority in sorted(ttfts):
        row[f"p{priority}_ttft_p50_s"] = pct(ttfts[priority], 0.50)
        row[f"p{priority}_ttft_p99_s"] = pct(ttfts[priority], 0.99)
    shares = fair_shares(offered, sum(got.values()))
    row["jain"] = jain([got[t] / shares[t] for t in offered if shares[t] > 0])
    row["load_avg"] = os.getloadavg()[0]
    return row


def _cluster(args: argparse.Namespace, flow: bool) -> tuple[str, list[Any]]:
    """Start the workers and the router; return its URL and the processes."""
    speedup = args.speedup
    wall = 1.0 / speedup  # engine seconds to wall seconds
    procs: list[Any] = []
    router_args = ["router", "--port", str(router_port := free_port()),
                   "--health-interval", "1", "--flow-control", "on" if flow else "off"]
    if flow:
        deadline = (args.slo if args.deadline is None else args.deadline) * wall
        router_args += ["--flow-ttft-bound", str(args.bound * wall),
                        "--flow-max-wait", str(args.max_wait * wall),
                        "--flow-deadlines", f"0={deadline},1={deadline}"]
    try:
        for _ in range(args.workers):
            port, events, replay = free_port(), free_port(), free_port()
            procs.append(spawn(["worker", "--port", str(port), "--events-port", str(events),
                                "--replay-port", str(replay), "--speedup", str(speedup),
                                "--num-blocks", str(args.capacity_tokens // 32)],
                               f"http://127.0.0.1:{port}"))
            # a kvroute worker names its own event streams at /model_info
            router_args += ["--worker", f"http://127.0.0.1:{port}"]
        url = f"http://127.0.0.1:{router_port}"
        procs.append(spawn(router_args, url, health="/ready"))
    except BaseException:
        for proc in procs:
            stop(proc)
        raise
    return url, procs


def run_live(args: argparse.Namespace, base: Sequence[WorkloadRequest],
             tags: Mapping[str, tuple[int, str]], capacity: float) -> list[dict[str, Any]]:
    """Every load with flow control off and on, live (module docstring)."""
    rate = args.speedup  # arrivals per wall second, as a share of the engine's

    def decorate(req: WorkloadRequest) -> tuple[dict[str, Any], dict[str, str]]:
        priority, tenant = tags.get(req.request_id, (0, ""))
        return {"priority": priority}, {"x-kvroute-tenant": tenant}

    rows = []
    for load in args.loads:
        for mode in ("off", "on"):
            if mode not in args.modes.split(","):
                continue
            requests = scale_rate(base, capacity * load * rate)
            window = max(requests[-1].arrival_s - requests[0].arrival_s, 1e-9)
            url, procs = _cluster(args, mode == "on")
            try:
                records, _ = asyncio.run(replay_live(url, requests, concurrency=4096,
                                                     model=None, decorate=decorate))
            finally:
                for proc in procs:
                    stop(proc)
            rows.append({"load": load, "flow": mode,
                         **summarize_records(records, tags, args.slo, window, args.speedup)})
    return rows
