"""The benchmark's targets for ``kvroute``, checked on one run's rows and tallied over runs.

A run meets the targets when the ``kvroute`` policy has

- the lowest TTFT p50 of all policies in the run, and the lowest p99 (a tie counts as met);
- a hit rate of at least 95% of the pooled-cache bound (``hit_vs_pooled`` >= 0.95);
- load imbalance (max over mean busy time) of at most 1.3.

The policies it is measured against are the run's *peers*: every other row except kvroute's own
variants (names starting ``kvroute``), which are settings of ours, not alternatives a user
would pick instead. A run with no peer has no verdict.

Pure: rows in (as :func:`bench.report.summarize` makes them), a verdict out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["HIT_SHARE", "MAX_IMBALANCE", "describe", "summary_line", "tally", "verdict"]

#: Least share of the pooled-cache bound the hit rate must reach.
HIT_SHARE = 0.95
#: Most load imbalance allowed.
MAX_IMBALANCE = 1.3


def verdict(rows: Sequence[Mapping[str, Any]], policy: str = "kvroute") -> dict[str, Any] | None:
    """Check ``policy``'s row against its peers in ``rows``.

    Returns:
        ``None`` when ``policy`` did not run or no peer did; else a dict: ``policy``,
        ``met`` (every target), and per target (``p50``, ``p99``, ``hit``, ``imbalance``)
        ``{"met", "value", "bound"}``, where the TTFT targets' bound is the best peer's
        figure and also name it (``"peer"``).
    """
    ours = next((r for r in rows if r["policy"] == policy), None)
    peers = [r for r in rows if not str(r["policy"]).startswith("kvroute")]
    if ours is None or not peers:
        return None
    out: dict[str, Any] = {"policy": policy}
    for name, key in (("p50", "ttft_p50_s"), ("p99", "ttft_p99_s")):
        best = min(peers, key=lambda r: r[key])
        out[name] = {"met": ours[key] <= best[key], "value": ours[key], "bound": best[key],
                     "peer": best["policy"]}
    hit = ours["hit_vs_pooled"]
    out["hit"] = {"met": hit >= HIT_SHARE, "value": hit, "bound": HIT_SHARE}
    imbalance = ours["load_imbalance"]
    out["imbalance"] = {"met": imbalance <= MAX_IMBALANCE, "value": imbalance,
                        "bound": MAX_IMBALANCE}
    out["met"] = all(out[k]["met"] for k in ("p50", "p99", "hit", "imbalance"))
    return out


def describe(v: Mapping[str, Any]) -> str:
    """One line for the terminal: every target met, or each miss and by how much."""
    misses = []
    for name in ("p50", "p99"):
        t = v[name]
        if not t["met"]:
            misses.append(f"TTFT {name} {t['value']:.4f} s, {t['value'] / t['bound'] - 1:+.1%} "
                          f"against {t['peer']}'s {t['bound']:.4f}")
    if not v["hit"]["met"]:
        misses.append(f"hit {v['hit']['value']:.1%} of pooled (< {HIT_SHARE:.0%})")
    if not v["imbalance"]["met"]:
        misses.append(f"imbalance {v['imbalance']['value']:.2f} (> {MAX_IMBALANCE})")
    if not misses:
        return f"targets: {v['policy']} meets every target"
    return f"targets: {v['policy']} misses " + "; ".join(misses)


def tally(verdicts: Sequence[Mapping[str, Any] | None]) -> dict[str, int]:
    """Count, over runs with a verdict: ``runs``, ``met`` (every target) and each target met."""
    counts = {"runs": 0, "met": 0, "p50": 0, "p99": 0, "hit": 0, "imbalance": 0}
    for v in verdicts:
        if v is None:
            continue
        counts["runs"] += 1
        counts["met"] += bool(v["met"])
        for name in ("p50", "p99", "hit", "imbalance"):
            counts[name] += bool(v[name]["met"])
    return counts


def summary_line(counts: Mapping[str, int], policy: str = "kvroute") -> str:
    """The tally as one line."""
    n = counts["runs"]
    return (f"targets over {n} runs: {policy} meets every target in {counts['met']}; lowest "
            f"p50 in {counts['p50']}, lowest p99 in {counts['p99']}, hit >= {HIT_SHARE:.0%} of "
            f"pooled in {counts['hit']}, imbalance <= {MAX_IMBALANCE} in {counts['imbalance']}")
