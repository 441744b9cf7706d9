"""Worker topologies side by side: disaggregated prefill and decode against aggregated workers.

``python -m bench.replay --topologies 4,1p3d,2p2d --rate-scales 0.5,1,1.5 --policies
kvroute,kvroute[pd_local_prefill_tokens=0]`` (:mod:`bench.replay` hands the run here) simulates
every policy on every topology at every load, on the same workload, in virtual time
(:mod:`bench.sim`), and prints one table per load and seed: TTFT p50/p99, inter-token latency
p50/p99, output tokens a second, and the share of requests prefilled remotely. With several
seeds (``--seeds 201-203``) it ends with each figure's mean and its spread (max - min) over the
seeds, the yardstick a difference between two rows must pass.

A topology is ``N`` (N aggregated workers, role ``both``) or ``PpDd`` (P prefill workers and D
decode workers); every worker has ``--capacity-tokens`` of cache. The simulator prices a forward
pass that mixes prefill chunks and decode steps as one pass of both
(:meth:`workers.engine.timing.TimingModel.iteration_ms`, the H200 model), so an aggregated
worker's decode steps wait on the prefill chunks they share a pass with: the interference
disaggregation removes, and what its inter-token latency shows. A remote prefill's KV moves in
``tokens * kv_bytes_per_token / --kv-transfer-bandwidth`` seconds, overlapping the decode
worker's passes.

What it found (``docs/benchmarks.md``, "Disaggregated against aggregated workers", has the
tables and commands), on the ``system_prompt`` workload, 2,000 requests, where 4 aggregated
workers saturate near rate x20:
disaggregation buys inter-token latency with prefill capacity. At half that load 1 prefill + 3
decode cut ITL p99 from 34 ms to 11 ms but its one prefill worker saturated (TTFT p50 1.5 s
against 17 ms); 2 + 2 kept TTFT p50 near the aggregated (35 ms) with ITL p99 16-18 ms. From x20
up both splits saturate on one side (20-22k output tokens a second against 36k). Selective
disaggregation at x20, seeds 201-203: ``pd_local_prefill_tokens`` 256 against 0 cut 1p3d's
TTFT p50 from 4.46 s to 3.74 s (spread 0.27 s), ITL unchanged; on 2p2d no change beyond the
spread; 2048 moved 91% of the prefills back to decode workers, TTFT p50 1.1 s but ITL p99 48 ms
(the aggregated figure). The default stays 256.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bench.figures import mean

__all__ = ["parse_topology", "run_topologies", "topology_table"]

_SPEC = re.compile(r"(?:(\d+)p(\d+)d|(\d+))")


def parse_topology(spec: str) -> tuple[str, ...]:
    """Each worker's role for a topology spec: ``"4"`` (4 aggregated workers) or ``"1p3d"``
    (1 prefill, 3 decode).

    Raises:
        ValueError: not one of those forms, or no worker.
    """
    m = _SPEC.fullmatch(spec.strip())
    if m is None:
        raise ValueError(f"topology {spec!r} is not N (aggregated workers) or PpDd (P prefill, "
                         "D decode workers)")
    if m.group(3) is not None:
        roles = ("both",) * int(m.group(3))
    else:
        roles = ("prefill",) * int(m.group(1)) + ("decode",) * int(m.group(2))
    if not roles or (m.group(3) is None and not int(m.group(2))):
        raise ValueError(f"topology {spec!r} needs at least one worker that decodes")
    return roles


#: The figures of a topology row: key, heading, format (times in milliseconds).
_COLUMNS = (
    ("ttft_p50_s", "TTFT p50 ms", "{:.0f}", 1e3),
    ("ttft_p99_s", "p99", "{:.0f}", 1e3),
    ("itl_p50_s", "ITL p50 ms", "{:.1f}", 1e3),
    ("itl_p99_s", "p99", "{:.1f}", 1e3),
    ("output_tok_s", "out tok/s", "{:.0f}", 1.0),
    ("remote_prefill_share", "remote", "{:.0%}", 1.0),
    ("hit_rate", "hit", "{:.1%}", 1.0),
    ("prediction_error", "pred err", "{:.0%}", 1.0),
)


def topology_table(rows: Sequence[dict[str, Any]], title: str,
                   spread: dict[tuple[str, str], dict[str, float]] | None = None) -> str:
    """The rows (each with ``topology`` and ``policy``) as an aligned table; with ``spread``
    (per (topology, policy), each figure's max - min over seeds) every cell reads
    ``mean ±spread/2``."""
    head = ["topology", "policy", *(h for _, h, _, _ in _COLUMNS)]
    body = []
    for row in rows:
        cells = [row["topology"], row["policy"]]
        for key, _, fmt, unit in _COLUMNS:
            value = row.get(key, math.nan)
            cell = "-" if isinstance(value, float) and math.isnan(value) else \
                fmt.format(value * unit)
            if spread is not None and cell != "-":
                half = spread[(row["topology"], row["policy"])][key] / 2 * unit
                cell += " ±" + fmt.format(half)
            cells.append(cell)
        body.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    lines = [title, "  ".join(h.rjust(w) if i > 1 else h.ljust(w)
                              for i, (h, w) in enumerate(zip(head, widths, strict=True)))]
    for cells in body:
        lines.append("  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(cells, widths, strict=True))))
    return "\n".join(lines)


def _simulate(args: argparse.Namespace, seed: int, scale: float, topology: str,
              policy: str) -> dict[str, Any]:
    """One simulation's row (run in this process or in a ``--jobs`` process)."""
    from bench.replay_setup import build_policies, build_sim_config, build_workload
    from bench.report import summarize
    from bench.sim import simulate

    requests, _ = build_workload(replace_scale(args, scale), seed)
    roles = parse_topology(topology)
    config = replace(build_sim_config(args, args.event_lag_ms), workers=len(roles), roles=roles)
    (chosen,) = build_policies(args, policy)
    row = summarize(simulate(requests, chosen, config, seed=seed), None)
    row.update(topology=topology, seed=seed, rate_scale=scale)
    return row


def replace_scale(args: argparse.Namespace, scale: float) -> argparse.Namespace:
    """``args`` with ``--rate-scale`` set to ``scale``."""
    return argparse.Namespace(**{**vars(args), "rate_scale": scale})


def run_topologies(args: argparse.Namespace) -> int:
    """Run the topology comparison the parsed arguments describe (module docstring); return
    the exit status (2 on a bad setting, its message on stderr)."""
    from bench.policies import make_policies
    from bench.replay_setup import build_sim_config, parse_router_changes
    from bench.report import write_json

    try:
        topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
        for t in topologies:
            roles = parse_topology(t)
            replace(build_sim_config(args, args.event_lag_ms), workers=len(roles), roles=roles)
        policies = [p.name for p in make_policies(args.policies)]
        bad = [p.name for p in make_policies(args.policies) if not p.disaggregates]
        if bad and any(r != "both" for t in topologies for r in parse_topology(t)):
            raise ValueError(f"policies {bad} do not route for prefill and decode roles")
        parse_router_changes(args.router_settings)
        scales = [float(s) for s in (args.rate_scales or str(args.rate_scale)).split(",")]
        if not topologies or not all(s > 0 and math.isfinite(s) for s in scales):
            raise ValueError("--topologies needs a topology and --rate-scales positive scales")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seeds = args.seeds if args.seeds is not None else [args.seed]
    # On aggregated workers the disaggregation settings change nothing: a policy that
    # differs from an earlier one only in those runs once, its row shown under both names.
    same = _aggregated_twins(args, policies)
    specs = [(seed, scale, topology, policy) for seed in seeds for scale in scales
             for topology in topologies for policy in policies
             if not (policy in same and "p" not in topology)]
    rows = _run(args, specs)
    for (seed, scale, topology, policy), row in list(rows.items()):
        for twin, of in same.items():
            if of == policy and "p" not in topology:
                rows[(seed, scale, topology, twin)] = {**row, "policy": twin}
    for seed in seeds:
        for scale in scales:
            title = (f"{args.generator if args.generator != 'trace' else 'trace'}, rate x"
                     f"{scale:g}, {args.capacity_tokens:,} tokens a worker, seed {seed}")
            print(topology_table([rows[(seed, scale, t, p)] for t in topologies
                                  for p in policies], title))
            print()
    if len(seeds) > 1:
        for scale in scales:
            means, spread = [], {}
            for t in topologies:
                for p in policies:
                    runs = [rows[(seed, scale, t, p)] for seed in seeds]
                    figures = {key: [r[key] for r in runs] for key, *_ in _COLUMNS}
                    means.append({"topology": t, "policy": p,
                                  **{k: mean(v) for k, v in figures.items()}})
                    spread[(t, p)] = {k: max(v) - min(v) for k, v in figures.items()}
            print(topology_table(means, f"rate x{scale:g}: mean ±half the spread over seeds "
                                 f"{','.join(map(str, seeds))}", spread))
            print()
    if args.json_path:
        write_json(args.json_path, {"settings": {k: v for k, v in vars(args).items()
                                                 if not callable(v)},
                                    "rows": list(rows.values())})
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0


def _aggregated_twins(args: argparse.Namespace, names: list[str]) -> dict[str, str]:
    """Each policy that equals an earlier one but for its ``pd_*`` settings -> that one."""
    from bench.policies import KvroutePolicy
    from bench.replay_setup import build_policies

    plain: dict[str, Any] = {}
    twins = {}
    for name in names:
        (policy,) = build_policies(args, name)
        if not isinstance(policy, KvroutePolicy):
            continue
        key = replace(policy.settings, pd_local_prefill_tokens=0, pd_prefill_timeout=1.0)
        for earlier, other in plain.items():
            if other == key:
                twins[name] = earlier
                break
        else:
            plain[name] = key
    return twins


def _run(args: argparse.Namespace, specs: list[tuple[int, float, str, str]]
         ) -> dict[tuple[int, float, str, str], dict[str, Any]]:
    if args.jobs == 1:
        return {spec: _simulate(args, *spec) for spec in specs}
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(args.jobs, len(specs))) as pool:
        futures = {spec: pool.submit(_simulate, args, *spec) for spec in specs}
        return {spec: future.result() for spec, future in futures.items()}
