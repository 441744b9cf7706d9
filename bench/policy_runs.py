"""The Results of docs/benchmarks.md, computed again from the runs behind them.

``docs/results/policy_runs.json`` holds every run of the routing benchmark that the Results
section reports (each printed by ``python -m bench.replay`` with its configuration and seed).
``python -m bench.policy_runs`` reads it and prints, in a second:

- the "Generated workloads" table: per configuration, runs, runs meeting every target
  (:func:`bench.targets.verdict` against SGLang, llm-d and Dynamo), kvroute's TTFT p50 / p99 and
  the best peer's (geometric means over the seeds, ms), kvroute's lowest hit rate as a share of
  the pooled bound and its highest load imbalance;
- each run that misses a target, with the miss (as ``bench.replay``'s targets line says it);
- the tally over every run in the file, and kvroute's lowest hit rate (share of the pooled
  bound) and highest load imbalance over them.

``--check`` compares the table with the one in docs/benchmarks.md and exits 1 naming each row
that differs (``tests/bench/test_policy_runs.py`` runs it in ``make test``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.targets import describe, summary_line, tally, verdict

__all__ = ["check", "misses", "table", "verdicts"]

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "results" / "policy_runs.json"
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "### Generated workloads"
#: The peers every run holds, as the table names them.
PEERS = {"sglang_cache_aware": "SGLang", "llmd_precise": "llm-d", "dynamo": "Dynamo"}
_GENERATORS = ("system_prompt", "images", "multi_turn", "agentic")


def _load(path: Path = RUNS) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))["runs"]
    return runs


def _verdict(run: dict[str, Any]) -> dict[str, Any] | None:
    # kvroute against the peers only: the file's other kvroute_* rows are variants
    rows = [{"policy": p, **v} for p, v in run["rows"].items() if p == "kvroute" or p in PEERS]
    return verdict(rows)


def verdicts(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Each run's verdict for kvroute against the peers."""
    return [_verdict(run) for run in runs]


def _geomean(values: Sequence[float]) -> float:
    return math.exp(math.fsum(math.log(v) for v in values) / len(values))


def table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The "Generated workloads" table's rows, in the doc's order and format."""
    cells: dict[tuple[str, int, int, float], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        c = run["cell"]
        if c["generator"] in _GENERATORS:
            cells[(c["generator"], c["workers"], c["capacity"], c["rate_scale"])].append(run)
    rows = []
    for key in sorted(cells, key=lambda k: (_GENERATORS.index(k[0]), -k[1], k[2], k[3])):
        generator, workers, capacity, rate = key
        group = cells[key]
        ours = [run["rows"]["kvroute"] for run in group]
        met = sum(bool(v and v["met"]) for v in verdicts(group))
        best = {}
        for figure in ("ttft_p50_s", "ttft_p99_s"):
            means = {p: _geomean([run["rows"][p][figure] for run in group]) for p in PEERS}
            peer = min(means, key=means.__getitem__)
            best[figure] = f"{PEERS[peer]} {means[peer] * 1e3:.1f}"
        p50 = _geomean([r["ttft_p50_s"] for r in ours]) * 1e3
        p99 = _geomean([r["ttft_p99_s"] for r in ours]) * 1e3
        rows.append(f"| `{generator}` | {workers} x {capacity / 1e6:g}M | x{rate:g} | "
                    f"{len(group)} | {met} | {p50:.1f} / {p99:.1f} | {best['ttft_p50_s']} | "
                    f"{best['ttft_p99_s']} | {min(r['hit_vs_pooled'] for r in ours):.1%} | "
                    f"{max(r['load_imbalance'] for r in ours):.2f} |")
    return rows


def misses(runs: Sequence[dict[str, Any]]) -> list[str]:
    """One line per run that misses a target: its cell and the miss."""
    found = []
    for run, v in zip(runs, verdicts(runs), strict=True):
        if v is not None and not v["met"]:
            c = run["cell"]
            found.append(f"{c['generator']} {c['workers']} x {c['capacity'] / 1e6:g}M "
                         f"x{c['rate_scale']:g} seed {c['seed']}: "
                         + describe(v).removeprefix("targets: "))
    return found


def _doc_rows(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    body = text.split(f"\n{SECTION}\n", 1)[1].split("\n#", 1)[0]
    return [line for line in body.splitlines() if line.startswith("| `")]


def check(doc: Path = DOC, runs_path: Path = RUNS) -> list[str]:
    """How the doc's table differs from the one computed now, one line each (empty: none)."""
    written, now = _doc_rows(doc), table(_load(runs_path))
    problems = [f"{doc.name} says {w}\n  python -m bench.policy_runs prints {n}"
                for w, n in zip(written, now, strict=False) if w != n]
    if len(written) != len(now):
        problems.append(f"{doc.name} has {len(written)} rows, python -m bench.policy_runs "
                        f"prints {len(now)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Print the Results' generated-workloads table, the misses and the tally, or check."""
    parser = argparse.ArgumentParser(prog="python -m bench.policy_runs",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS, help="the runs (JSON)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/benchmarks.md's table differs from the runs'")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(runs_path=args.runs)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    runs = _load(args.runs)
    print("\n".join(table(runs)))
    print()
    print("\n".join(misses(runs)))
    print()
    print(summary_line(tally(verdicts(runs))))
    ours = [run["rows"]["kvroute"] for run in runs]
    print(f"kvroute over every run: hit >= {min(r['hit_vs_pooled'] for r in ours):.1%} of "
          f"pooled, imbalance <= {max(r['load_imbalance'] for r in ours):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
