"""What a benchmark run reports: per-policy figures, a terminal table, JSON and PNG plots.

Figures per policy (:data:`METRIC_KEYS`):

- ``hit_rate``: prompt tokens found cached at first admission / prompt tokens; and
  ``hit_vs_pooled``, that over the pooled-LRU bound (:mod:`bench.bounds`).
- ``ttft_mean_s``, ``ttft_p50_s``, ``ttft_p90_s``, ``ttft_p99_s``; ``e2e_mean_s``,
  ``e2e_p50_s``, ``e2e_p99_s``. The mean is there because a median alone can reward an
  imbalanced cluster: when a third of the requests land on lightly loaded workers, the median
  falls while most others wait longer (``docs/benchmarks.md``, "The ``multi_turn`` median").
- ``itl_p50_s``, ``itl_p99_s``: inter-token latency, over every gap between two consecutive
  output tokens of a request.
- ``remote_prefill_share``: the share of requests prefilled on a prefill worker (disaggregated
  serving, :mod:`bench.sim`).
- ``fetch_share``, ``fetch_bytes``, ``fetches``, ``fetches_instructed``: peer fetch
  (``--peer-fetch``, :mod:`bench.sim`): the share of prompt tokens fetched from a peer (they
  count in ``hit_rate``, as the engine finds them cached), their KV bytes, the fetches that
  inserted blocks and those the policy instructed; ``copied_by_fetch_tokens`` and
  ``copied_by_recompute_tokens``: the prompt tokens of the leading runs other workers held
  beyond the chosen one's, copied there by a fetch or recomputed there (a second copy
  made either way, :class:`bench.sim.Regret`).
- ``output_tok_s``: output tokens over the makespan (first arrival to last token).
- ``load_imbalance``: max over mean of the workers' busy time (1.0 is perfect balance).
- ``decision_us_mean``, ``decision_us_p99``: wall time of the routing decision (hashing,
  index match and scoring), on this machine, in Python.
- ``hit_lost``, ``time_lost``: the share of decisions that lost a hit (another worker held
  more of the prompt with no more prefill queued) or time (another worker's estimated TTFT
  was lower by more than 25%), judged against the simulated cluster as it was
  (:class:`bench.sim.Regret`).
- ``prediction_error``, ``prediction_p50_error``: for a policy that predicts its TTFT
  (``kvroute``), the median of each request's ``|predicted - delivered| / delivered``, and the
  predicted p50 against the delivered p50 (signed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.bounds import Bounds
from bench.figures import mean, percentile
from bench.sim import SimResult

__all__ = ["LIVE_COLUMNS", "METRIC_KEYS", "per_worker", "per_worker_table", "percentile", "plot",
           "prediction_error", "summarize", "table", "write_json"]

#: Keys of every policy's row, in table order.
METRIC_KEYS = (
    "policy",
    "hit_rate",
    "hit_vs_pooled",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "e2e_mean_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "remote_prefill_share",
    "fetch_share",
    "fetch_bytes",
    "output_tok_s",
    "load_imbalance",
    "decision_us_mean",
    "decision_us_p99",
    "requests",
    "preemptions",
    "makespan_s",
    "wall_s",
    "hit_lost",
    "time_lost",
    "prediction_error",
    "prediction_p50_error",
)


def summarize(result: SimResult, bounds: Bounds | None) -> dict[str, Any]:
    """Return one policy's row (:data:`METRIC_KEYS`, plus event-path timings)."""
    recs = result.records
    prompt = sum(r.prompt_tokens for r in recs)
    hit = sum(max(r.cached_tokens, 0) for r in recs) / prompt if prompt else 0.0
    ttft = [r.ttft_s for r in recs]
    e2e = [r.e2e_s for r in recs]
    busy = result.busy_s
    mean_busy = sum(busy) / len(busy)
    out = sum(r.tokens_out for r in recs)
    decision = [d * 1e6 for d in result.decision_s]
    row: dict[str, Any] = {
        "policy": result.policy,
        "hit_rate": hit,
        "hit_vs_pooled": hit / bounds.pooled_lru if bounds and bounds.pooled_lru else math.nan,
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_mean_s": mean(e2e),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "itl_p50_s": percentile(result.token_gaps_s, 50),
        "itl_p99_s": percentile(result.token_gaps_s, 99),
        "remote_prefill_share": sum(r.prefill_worker >= 0 for r in recs) / len(recs)
        if recs else math.nan,
        "output_tok_s": out / result.makespan_s if result.makespan_s > 0 else math.nan,
        "load_imbalance": max(busy) / mean_busy if mean_busy > 0 else math.nan,
        "decision_us_mean": sum(decision) / len(decision) if decision else math.nan,
        "decision_us_p99": percentile(decision, 99),
        "requests": len(recs),
        "preemptions": result.preemptions,
        "makespan_s": result.makespan_s,
        "wall_s": result.wall_s,
        "event_wall_s": dict(result.event_wall_s),
        "event_batches": result.event_batches,
        "event_bytes": result.event_bytes,
        # Peer fetch: the share of prompt tokens fetched from a peer (counted in hit_rate,
        # as the engine finds them cached), the bytes, and the fetches made and instructed.
        "fetch_share": result.fetched_tokens / prompt if prompt else 0.0,
        "fetch_bytes": result.fetch_bytes,
        "fetch_gb": result.fetch_bytes / 1e9,
        "fetches": result.fetched,
        "fetches_instructed": result.fetches,
        # Second copies of blocks another worker held: made by a fetch, or recomputed.
        "copied_by_fetch_tokens": result.regret.copied_by_fetch,
        "copied_by_recompute_tokens": result.regret.copied_by_recompute,
        "hit_lost": result.regret.hit_lost / max(result.regret.decisions, 1),
        "time_lost": result.regret.time_lost / max(result.regret.decisions, 1),
        **prediction_error(result.predictions),
    }
    return row


def prediction_error(predictions: list[tuple[float, float]] | None) -> dict[str, float]:
    """The median relative error of each predicted TTFT against the delivered one, and the
    error of the predicted p50 against the delivered p50 (NaN for a policy that does not
    predict)."""
    pairs = [(p, d) for p, d in predictions or () if d > 0]
    if not pairs:
        return {"prediction_error": math.nan, "prediction_p50_error": math.nan}
    delivered = percentile([d for _, d in pairs], 50)
    return {"prediction_error": percentile([abs(p - d) / d for p, d in pairs], 50),
            "prediction_p50_error": (percentile([p for p, _ in pairs], 50) - delivered)
            / delivered}


def per_worker(result: SimResult) -> list[dict[str, Any]]:
    """Return one row per worker: the requests it served, their TTFT mean and p50, its busy
    seconds, and the decode context its iterations carried on average (tokens; what an
    iteration's length grows with, so what a request arriving there waits on)."""
    ttft: list[list[float]] = [[] for _ in result.busy_s]
    for r in result.records:
        ttft[r.worker].append(r.ttft_s)
    context = result.decode_context_s or [math.nan] * len(result.busy_s)
    return [{"worker": w, "requests": len(t), "ttft_mean_s": mean(t),
             "ttft_p50_s": percentile(t, 50), "busy_s": busy,
             "decode_context_tokens": ctx / busy if busy > 0 else math.nan}
            for w, (t, busy, ctx) in enumerate(zip(ttft, result.busy_s, context, strict=True))]


_WORKER_COLUMNS = (
    ("worker", "worker", "{}"),
    ("requests", "requests", "{}"),
    ("ttft_mean_s", "TTFT mean", "{:.3f}"),
    ("ttft_p50_s", "p50", "{:.3f}"),
    ("busy_s", "busy s", "{:.1f}"),
    ("decode_context_tokens", "decode context", "{:,.0f}"),
)


def per_worker_table(rows: Sequence[dict[str, Any]], title: str = "") -> str:
    """Return :func:`per_worker`'s rows as an aligned text table."""
    return _aligned(rows, _WORKER_COLUMNS, title)


_COLUMNS = (
    ("policy", "policy", "{}"),
    ("hit_rate", "hit", "{:.1%}"),
    ("hit_vs_pooled", "/pool", "{:.0%}"),
    ("ttft_mean_s", "TTFT mean", "{:.3f}"),
    ("ttft_p50_s", "p50", "{:.3f}"),
    ("ttft_p90_s", "p90", "{:.3f}"),
    ("ttft_p99_s", "p99", "{:.3f}"),
    ("e2e_p50_s", "E2E p50", "{:.3f}"),
    ("e2e_p99_s", "p99", "{:.3f}"),
    ("hit_lost", "hit lost", "{:.1%}"),
    ("time_lost", "time lost", "{:.1%}"),
    ("prediction_error", "pred err", "{:.0%}"),
    ("prediction_p50_error", "p50 err", "{:+.0%}"),
    ("fetch_share", "fetched", "{:.1%}"),
    ("fetch_gb", "fetch GB", "{:.1f}"),
    ("output_tok_s", "out tok/s", "{:.0f}"),
    ("load_imbalance", "imbal", "{:.2f}"),
    ("decision_us_mean", "dec us", "{:.0f}"),
    ("wall_s", "wall s", "{:.1f}"),
)


#: A live run's columns: what a client sees, inter-token latency beside TTFT.
LIVE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("hit_rate", "hit", "{:.1%}"),
    ("ttft_mean_s", "TTFT mean", "{:.3f}"),
    ("ttft_p50_s", "p50", "{:.3f}"),
    ("ttft_p99_s", "p99", "{:.3f}"),
    ("itl_p50_s", "ITL p50", "{:.4f}"),
    ("itl_p99_s", "p99", "{:.4f}"),
    ("e2e_p50_s", "E2E p50", "{:.3f}"),
    ("e2e_p99_s", "p99", "{:.3f}"),
    ("output_tok_s", "out tok/s", "{:.0f}"),
    ("prediction_error", "pred err", "{:.0%}"),
    ("errors", "errors", "{}"),
    ("wall_s", "wall s", "{:.1f}"),
)


def table(rows: Sequence[dict[str, Any]], title: str = "",
          columns: Sequence[tuple[str, str, str]] = _COLUMNS) -> str:
    """Return the rows as an aligned text table (times in seconds), in ``columns`` (key,
    heading, format; default the simulation's)."""
    return _aligned(rows, columns, title)


def _cell(value: Any, fmt: str) -> str:
    """``value`` in ``fmt``; a missing figure (NaN, or absent) as ``-``."""
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def _aligned(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]],
             title: str) -> str:
    head = [h for _, h, _ in columns]
    body = [[_cell(row.get(key, math.nan), fmt) for key, _, fmt in columns] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) if i else h.ljust(w)
                           for i, (h, w) in enumerate(zip(head, widths, strict=True))))
    for cells in body:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(cells, widths, strict=True))))
    return "\n".join(lines)


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """Write the run's document (settings, bounds, rows) as JSON; NaN becomes null."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(clean(document), indent=2) + "\n", encoding="utf-8")


def plot(plot_dir: str | Path, ttfts: Mapping[str, Sequence[float]],
         rows: Sequence[dict[str, Any]], bounds: Bounds | None, tag: str = "") -> list[Path]:
    """Write ``ttft_cdf{tag}.png`` (TTFT CDF per policy; ``ttfts``: policy -> its requests'
    TTFTs in seconds) and ``hit_rate{tag}.png`` (hit rate per row against the bounds); return
    their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(plot_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in ttfts.items():
        ttft = sorted(values)
        n = len(ttft)
        ax.plot(ttft, [(i + 1) / n for i in range(n)], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT CDF per policy {tag}".strip())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"ttft_cdf{tag}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["policy"] for r in rows]
    ax.bar(range(len(rows)), [r["hit_rate"] for r in rows], color="tab:blue")
    if bounds is not None:
        ax.axhline(bounds.pooled_lru, color="tab:orange", linestyle="--",
                   label=f"pooled LRU {bounds.pooled_lru:.1%}")
        ax.axhline(bounds.unlimited, color="tab:red", linestyle=":",
                   label=f"unlimited {bounds.unlimited:.1%}")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("prefix hit rate (tokens)")
    ax.set_title(f"Hit rate against the bounds {tag}".strip())
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / f"hit_rate{tag}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
