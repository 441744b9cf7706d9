"""Capacity at a TTFT SLO: the highest load a policy sustains while its TTFT p99 stays under
the SLO, found by bisection over loads, and the goodput there.

A TTFT ratio at one load says little: below saturation neither policy waits, above it both
queue without bound. The fair comparison is the load each sustains at the same SLO, and the
ratio of the two (``kv`` over ``round_robin``). :func:`search_capacity` takes any probe (a
function from a load to a result row) so that the simulated replay (``python -m bench.replay
--slo S``, :func:`run_replay_capacity`) and the benchmark over real engines (``python -m
bench.gpu_routing --slo S``) search the same way and print the same figures.

The search: probe ``lo``; if it misses the SLO the capacity is below the range (reported as
0). Probe ``hi``; if it meets the SLO the capacity is at least ``hi`` (reported as ``hi``,
marked ``at_least``). Otherwise bisect ``steps`` times between the highest load that met the
SLO and the lowest that missed it. A probe meets the SLO when its TTFT p99 is at most the SLO
and no request failed. Goodput: requests per second, and their prompt tokens per second,
among those whose TTFT met the SLO, at the sustained load's probe.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["capacity_table", "meets", "run_replay_capacity", "search_capacity",
           "sustained_ratio"]


def meets(row: dict[str, Any], slo_s: float) -> bool:
    """Whether a probe's row meets the SLO: TTFT p99 at most ``slo_s``, no failed request."""
    p99 = row.get("ttft_p99_s", math.nan)
    return not math.isnan(p99) and p99 <= slo_s and not row.get("errors", 0)


def search_capacity(probe: Callable[[float], dict[str, Any]], *, slo_s: float, lo: float,
                    hi: float, steps: int) -> dict[str, Any]:
    """The highest load in ``[lo, hi]`` whose probe meets the SLO (module docstring).

    Returns:
        ``sustained`` (the load; 0 below the range), ``at_least`` (True when ``hi`` met it),
        ``row`` (the sustained probe's row, or None) and ``probes`` (every probe's load, TTFT
        p99 and verdict, in order).

    Raises:
        ValueError: ``lo`` not positive, ``hi`` not above it, or a negative ``steps``.
    """
    if not 0 < lo < hi or steps < 0:
        raise ValueError(f"a capacity search needs 0 < lo < hi and steps >= 0, got lo {lo}, "
                         f"hi {hi}, steps {steps}")
    probes: list[dict[str, Any]] = []

    def run(load: float) -> tuple[bool, dict[str, Any]]:
        row = probe(load)
        ok = meets(row, slo_s)
        probes.append({"load": load, "ttft_p99_s": row.get("ttft_p99_s"), "meets": ok})
        return ok, row

    ok, row = run(lo)
    if not ok:
        return {"sustained": 0.0, "at_least": False, "row": None, "probes": probes}
    best, best_row = lo, row
    ok, row = run(hi)
    if ok:
        return {"sustained": hi, "at_least": True, "row": row, "probes": probes}
    low, high = lo, hi
    for _ in range(steps):
        mid = (low + high) / 2
        ok, row = run(mid)
        if ok:
            low, best, best_row = mid, mid, row
        else:
            high = mid
    return {"sustained": best, "at_least": False, "row": best_row, "probes": probes}


#: The KV-aware policy's name in each benchmark: the router's ``--policy kv``, the replay's
#: ``kvroute``.
KV_NAMES = ("kv", "kvroute")


def sustained_ratio(results: dict[str, dict[str, Any]], under: str = "round_robin"
                    ) -> float | None:
    """The KV-aware policy's sustained load over ``under``'s; None where either is missing or
    sustained nothing."""
    over = next((name for name in KV_NAMES if name in results), None)
    if over is None or under not in results:
        return None
    a, b = results[over]["sustained"], results[under]["sustained"]
    return a / b if a and b else None


def capacity_table(results: dict[str, dict[str, Any]], slo_s: float, unit: str) -> str:
    """One line per policy (sustained load, goodput there, the probes), then the ratio."""
    lines = [f"capacity at TTFT p99 <= {slo_s:g} s ({unit}):"]
    for policy, r in results.items():
        row = r["row"] or {}
        probes = ", ".join(f"{p['load']:.3g}:{p['ttft_p99_s']:.2f}{'+' if p['meets'] else '-'}"
                           for p in r["probes"])
        lines.append(
            f"  {policy:>12}: sustains {'>= ' if r['at_least'] else ''}{r['sustained']:.3g}"
            f"; goodput there {row.get('goodput_req_s', math.nan):.2f} req/s, "
            f"{row.get('goodput_prompt_tok_s', math.nan):,.0f} prompt tok/s, hit "
            f"{row.get('hit_rate', math.nan):.1%}, TTFT p50 {row.get('ttft_p50_s', math.nan):.3f}"
            f" s  [probes load:p99 {probes}]")
    ratio = sustained_ratio(results)
    if ratio is not None:
        lines.append(f"  kv sustains {ratio:.2f}x round-robin's load at this SLO")
    return "\n".join(lines)


def goodput(ttfts: Sequence[float], prompts: Sequence[int], makespan_s: float,
            slo_s: float) -> tuple[float, float]:
    """Requests/s and prompt tokens/s of the requests whose TTFT met ``slo_s``."""
    if makespan_s <= 0:
        return 0.0, 0.0
    good = [(t, p) for t, p in zip(ttfts, prompts, strict=True) if t <= slo_s]
    return len(good) / makespan_s, sum(p for _, p in good) / makespan_s


def run_replay_capacity(args: argparse.Namespace) -> int:
    """``python -m bench.replay --slo S``: for each policy, the highest ``--rate-scale`` (in
    ``--capacity-range``) at which the simulated TTFT p99 stays under S, bisected
    ``--capacity-steps`` times; goodput there, and kv's sustained scale over round-robin's.
    One seed (``--seed``), no lag sweep."""
    from bench.policies import make_policies
    from bench.replay_setup import build_policies, build_sim_config, build_workload
    from bench.report import summarize
    from bench.sim import simulate
    from bench.workloads import scale_rate

    try:
        lo, hi = (float(x) for x in args.capacity_range.split(","))
        names = [p.name for p in make_policies(args.policies)]
        base, name = build_workload(replace_args(args, rate_scale=1.0), args.seed)
        config = build_sim_config(args, args.event_lag_ms)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not base:
        print("error: the workload has no requests", file=sys.stderr)
        return 2
    span = (base[-1].arrival_s - base[0].arrival_s) or 1.0
    prompt_rate = sum(r.input_length for r in base) / span
    results: dict[str, dict[str, Any]] = {}
    for policy_name in names:
        def probe(scale: float, policy_name: str = policy_name) -> dict[str, Any]:
            (policy,) = build_policies(args, policy_name)
            res = simulate(scale_rate(base, scale), policy, config, seed=args.seed)
            row = summarize(res, None)
            row["goodput_req_s"], row["goodput_prompt_tok_s"] = goodput(
                [r.ttft_s for r in res.records], [r.prompt_tokens for r in res.records],
                res.makespan_s, args.slo)
            row["prompt_tok_s_offered"] = prompt_rate * scale
            return row

        try:
            results[policy_name] = search_capacity(probe, slo_s=args.slo, lo=lo, hi=hi,
                                              steps=args.capacity_steps)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"workload {name}: {len(base)} requests, {prompt_rate:,.0f} prompt tok/s offered at "
          f"rate x1, {args.workers} simulated workers")
    print(capacity_table(results, args.slo, "load = --rate-scale"))
    if args.json_path:
        from bench.report import write_json

        write_json(args.json_path, {"workload": name, "slo_s": args.slo,
                                    "prompt_tok_s_at_1": prompt_rate,
                                    "ratio": sustained_ratio(results),
                                    "policies": {p: {k: v for k, v in r.items() if k != "row"}
                                                 | {"row": r["row"]}
                                                 for p, r in results.items()}})
    return 0


def replace_args(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    """A copy of ``args`` with ``changes``."""
    return argparse.Namespace(**(vars(args) | changes))
