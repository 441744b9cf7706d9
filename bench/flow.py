"""Flow control under load, in simulation: the router with flow control on and off, side by
side, at fractions of the fleet's capacity.

``python -m bench.flow`` generates a workload (``--workload``, default ``system_prompt``),
tags each session with a priority and a tenant (a share ``--high-share`` of sessions is
interactive: priority 0, tenant ``chat``; the rest is batch at priority 1, from tenant
``bulk-a`` ten times as often as from ``bulk-b``, equal weights), finds the fleet's capacity
(the highest arrival rate at which the router without
flow control keeps its TTFT p99 under ``--slo``; :func:`bench.capacity.search_capacity`),
and replays the workload at ``--loads`` times that rate through :func:`bench.sim.simulate`
with ``kvroute`` (flow control off) and ``kvroute+flow``
(:class:`~bench.policies.flow_policy.FlowPolicy`, the router's rules and bounds; ``--modes``
may add ``lax``, the same without the room kept for the urgent; the TTFT bound is
``--bound``, and every request's TTFT deadline is ``--deadline``, by default the SLO: a
request that cannot meet it is refused at once rather than served too late).

``--live`` runs the same loads through the real router and ``kvroute worker`` processes
instead (:mod:`bench.flow_live`).

Per load and mode it prints: goodput (requests per second of the arrival window whose TTFT
met the SLO), the shares of requests that waited in the router and that were shed, TTFT p50
and p99 per priority (served requests; ``p0`` interactive, ``p1`` batch), and Jain's
fairness index across tenants. The index is taken over each tenant's goodput tokens divided
by its max-min fair share of the goodput tokens served in all (water-filling over what each
tenant offered): 1 when every tenant got its fair share, lower when a heavy tenant took a
light one's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench.capacity import search_capacity
from bench.policies.flow_policy import FlowPolicy
from bench.policies.kvroute_policy import KvroutePolicy
from bench.sim import SimConfig, SimResult, simulate
from bench.workloads import GENERATORS, GeneratorConfig, WorkloadRequest, scale_rate
from router.settings import RouterSettings

__all__ = ["fair_shares", "jain", "main", "pct", "run", "summarize", "tag"]


def tag(requests: Sequence[WorkloadRequest], seed: int, high_share: float
        ) -> dict[str, tuple[int, str]]:
    """Each request's priority and tenant, drawn per session (module docstring)."""
    out: dict[str, tuple[int, str]] = {}
    drawn: dict[str, tuple[int, str]] = {}
    for r in requests:
        key = r.request_id.split(".")[0]  # a session's turns are "s3.0", "s3.1", ...
        if key not in drawn:
            rng = random.Random(f"flow:{seed}:{key}")
            if rng.random() < high_share:
                drawn[key] = (0, "chat")
            else:
                drawn[key] = (1, "bulk-a" if rng.random() < 10 / 11 else "bulk-b")
        out[r.request_id] = drawn[key]
    return out


def fair_shares(offered: Mapping[str, float], total: float) -> dict[str, float]:
    """Max-min fair shares of ``total`` among tenants that ``offered`` so much each."""
    shares = dict.fromkeys(offered, 0.0)
    left = dict(offered)
    remaining = total
    while left and remaining > 1e-9:
        even = remaining / len(left)
        small = {t: d for t, d in left.items() if d <= even}
        if not small:
            for t in left:
                shares[t] += even
            break
        for t, d in small.items():
            shares[t] += d
            remaining -= d
            del left[t]
    return shares


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: ``(sum x)^2 / (n sum x^2)``; 1 when all are equal."""
    square = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * square) if square else 1.0


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values``; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def summarize(result: SimResult, tags: Mapping[str, tuple[int, str]], slo_s: float,
              window_s: float, held: int = 0) -> dict[str, Any]:
    """One run's row (module docstring); ``held``: requests that waited in the router."""
    row: dict[str, Any] = {}
    good = shed = 0
    offered: dict[str, float] = {}
    got: dict[str, float] = {}
    ttfts: dict[int, list[float]] = {}
    for rec in result.records:
        priority, tenant = tags.get(rec.request_id, (0, ""))
        offered[tenant] = offered.get(tenant, 0.0) + rec.prompt_tokens
        got.setdefault(tenant, 0.0)
        if rec.shed:
            shed += 1
            continue
        ttfts.setdefault(priority, []).append(rec.ttft_s)
        if rec.ttft_s <= slo_s:
            good += 1
            got[tenant] += rec.prompt_tokens
    shares = fair_shares(offered, sum(got.values()))
    row["goodput_rps"] = good / window_s
    row["held"] = held / max(len(result.records), 1)
    row["shed"] = shed / max(len(result.records), 1)
    for priority in sorted(ttfts):
        row[f"p{priority}_ttft_p50_s"] = pct(ttfts[priority], 0.50)
        row[f"p{priority}_ttft_p99_s"] = pct(ttfts[priority], 0.99)
    row["jain"] = jain([got[t] / shares[t] for t in offered if shares[t] > 0])
    return row


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Find the capacity, then every load with flow control off and on."""
    config = dataclasses.replace(GeneratorConfig(), requests=args.requests, rate=args.rate)
    base = GENERATORS[args.workload](config, args.seed)
    tags = tag(base, args.seed, args.high_share)
    sim = SimConfig(workers=args.workers, capacity_tokens=args.capacity_tokens)
    off = RouterSettings(flow_control=False)
    deadline = args.slo if args.deadline is None else args.deadline
    on = RouterSettings(flow_ttft_bound=args.bound, flow_max_wait=args.max_wait,
                        flow_deadlines=f"0={deadline},1={deadline}")

    def replay(scale: float, settings: RouterSettings, flow: bool, keep_room: bool = True
               ) -> tuple[SimResult, float, int]:
        requests = scale_rate(base, scale)
        window = max(requests[-1].arrival_s - requests[0].arrival_s, 1e-9)
        policy = (FlowPolicy(settings, tags, keep_room=keep_room) if flow
                  else KvroutePolicy(settings))
        result = simulate(requests, policy, sim, args.seed)
        return result, window, len(policy.waits) if isinstance(policy, FlowPolicy) else 0

    def probe(scale: float) -> dict[str, Any]:
        result, _, _ = replay(scale, off, False)
        ttft = [r.ttft_s for r in result.records]
        return {"ttft_p99_s": pct(ttft, 0.99)}

    capacity = args.capacity
    if capacity is None:
        found = search_capacity(probe, slo_s=args.slo, lo=args.capacity_range[0],
                                hi=args.capacity_range[1], steps=args.capacity_steps)
        capacity = found["sustained"] or args.capacity_range[0]
    print(f"capacity: rate x{capacity:.3g} of {args.rate}/s ({args.workload}, "
          f"{args.workers} workers), TTFT p99 <= {args.slo} s without flow control",
          file=sys.stderr)
    if args.live:
        from bench.flow_live import run_live

        return run_live(args, base, tags, capacity)
    rows = []
    for load in args.loads:
        for mode, settings in (("off", off), ("lax", on), ("on", on)):
            if mode not in args.modes.split(","):
                continue
            result, window, held = replay(capacity * load, settings, mode != "off",
                                          keep_room=mode == "on")
            rows.append({"load": load, "flow": mode,
                         **summarize(result, tags, args.slo, window, held)})
    return rows


def _table(rows: Sequence[dict[str, Any]]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["  ".join(f"{k:>14}" for k in keys)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "")
            cells.append(f"{v:>14.3f}" if isinstance(v, float) else f"{v!s:>14}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def build_parser(prog: str = "python -m bench.flow") -> argparse.ArgumentParser:
    """The flags (module docstring)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--workload", default="system_prompt", choices=sorted(GENERATORS))
    a("--requests", type=int, default=2000)
    a("--rate", type=float, default=20.0, help="arrivals per second at x1 (default 20)")
    a("--workers", type=int, default=2)
    a("--capacity-tokens", type=int, default=500_000)
    a("--seed", type=int, default=1)
    a("--slo", type=float, default=1.0, help="TTFT SLO in seconds (default 1)")
    a("--bound", type=float, default=0.05,
      help="flow control's TTFT bound in seconds (default 0.05)")
    a("--deadline", type=float, default=None,
      help="every priority's TTFT deadline in seconds (default: the SLO)")
    a("--max-wait", type=float, default=30.0)
    a("--high-share", type=float, default=0.2)
    a("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1, 1.5, 2])
    a("--capacity-range", type=lambda s: tuple(float(x) for x in s.split(",")),
      default=(1.0, 64.0))
    a("--capacity-steps", type=int, default=5)
    a("--capacity", type=float, default=None,
      help="the rate scale taken as the capacity (default: searched)")
    a("--modes", default="off,on",
      help="which runs per load (default off,on; lax: flow control without the room kept "
      "for the urgent, every band leaving the queue when the queued work is within the bound)")
    a("--live", action="store_true",
      help="run the real router and simulated workers (bench.flow_live) instead of the "
      "simulation; the capacity is still searched in simulation unless --capacity is given")
    a("--speedup", type=float, default=0.1,
      help="--live: the workers' --speedup (default 0.1: ten times slower than the timing "
      "model, so the machine keeps up); times are reported in the model's seconds")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(_table(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
