"""The quick figures in docs/: computed again in seconds, and checked against the docs.

A figure in a doc is marked where it stands, by an HTML comment right after its value (a
reader of the rendered page sees only the value)::

    For the trace: unlimited 65.1%<!-- fig:trace_unlimited -->; ...

``python -m bench.docs_figures`` prints every figure with its value now; ``--check`` compares
them with the docs and exits 1 naming each that drifted (``tests/bench/test_docs_figures.py``
runs it in ``make test``); ``--write`` puts the values now into the docs. Figures that take
minutes (the routing benchmark's tables) are not here: the docs name the command that prints
each and the commit it was measured at (``tests/test_docs_figures_named.py`` fails on a table
of figures whose section names no command), and the tables computed from the runs in
``docs/results/`` are checked by ``python -m bench.policy_runs --check``.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.workloads import WorkloadRequest

__all__ = ["FIGURES", "Figure", "check", "marked"]

DOCS = Path(__file__).resolve().parents[1] / "docs"
_MARK = re.compile(r"(\S+?)<!-- fig:([a-z0-9_]+) -->")


@dataclass(frozen=True)
class Figure:
    """One figure: its name in the docs' markers, what prints it, and how to compute it."""

    name: str
    command: str
    compute: Callable[[], str]


@functools.cache
def _trace_bounds(workers: int, capacity_tokens: int) -> tuple[float, float]:
    # The trace at the benchmark's block size (32), as bench.replay computes its bounds line.
    from bench.bounds import compute_bounds

    requests, hashed = _trace()
    bounds = compute_bounds(requests, 32, workers, capacity_tokens // 32, hashed)
    return bounds.unlimited, bounds.pooled_lru


@functools.cache
def _trace() -> tuple[list[WorkloadRequest], list[tuple[list[int], int]]]:
    from bench.bounds import sequence_hashes
    from bench.workloads import DEFAULT_TRACE, load_trace

    requests = load_trace(DEFAULT_TRACE)
    return requests, [sequence_hashes(r, 32) for r in requests]


def _pooled(workers: int, capacity_tokens: int) -> Callable[[], str]:
    return lambda: f"{_trace_bounds(workers, capacity_tokens)[1]:.1%}"


def _timing(model: str, field: str, scale: float, fmt: str) -> Callable[[], str]:
    def compute() -> str:
        from workers.engine import timing

        # 4.43e-7, not 4.43e-07: as a person writes it
        return format(getattr(getattr(timing, model), field) * scale, fmt).replace("e-0", "e-")
    return compute


def _calibration(section: str, fmt: str, **point: int) -> Callable[[], str]:
    # One measured point of the H200 calibration, as the file holds it.
    def compute() -> str:
        import json

        path = Path(__file__).parent / "data" / "h200_llama1b_random.json"
        rows = json.loads(path.read_text(encoding="utf-8"))[section]
        row = next(r for r in rows if all(r[k] == v for k, v in point.items()))
        return format(row["ms"], fmt)
    return compute


def _rate(compute: Callable[[Any], float], fmt: str) -> Callable[[], str]:
    # The router's default rates (router/routing/rates.py), or what they price.
    def value() -> str:
        from router.routing.rates import DEFAULT_RATES

        return format(compute(DEFAULT_RATES["kvroute"]), fmt)
    return value


def _calibrated_decode() -> str:
    from workers.engine.timing import fit_timing

    path = Path(__file__).parent / "data" / "h200_llama1b_random.json"
    return f"{fit_timing(path).decode_per_context_ms * 1e6:.1f}"


_BOUNDS = "python -m bench.replay (its bounds line), or python -m bench.docs_figures"
_CALIBRATION = "python -m bench.docs_figures (bench/data/h200_llama1b_random.json)"
_RATES = "python -m bench.docs_figures (router/routing/rates.py)"
#: The cold prompt docs/routing.md prices with the default rates.
_LONG_PROMPT = 191_000
FIGURES = (
    Figure("trace_unlimited", _BOUNDS, lambda: f"{_trace_bounds(4, 500_000)[0]:.1%}"),
    Figure("trace_pooled_4x05", _BOUNDS, _pooled(4, 500_000)),
    Figure("trace_pooled_8x05", _BOUNDS, _pooled(8, 500_000)),
    Figure("trace_pooled_4x2", _BOUNDS, _pooled(4, 2_000_000)),
    Figure("trace_pooled_8x2", _BOUNDS, _pooled(8, 2_000_000)),
    Figure("measured_decode_ns", "python -m bench.docs_figures (workers/engine/timing.py)",
           _timing("H200_LLAMA_1B_MEASURED", "decode_per_context_ms", 1e6, ".2f")),
    Figure("measured_cached_pair_ms", "python -m bench.docs_figures (workers/engine/timing.py)",
           _timing("H200_LLAMA_1B_MEASURED", "prefill_per_token_cached_ms", 1, ".2e")),
    Figure("calibrated_decode_ns", "python -m bench.docs_figures (the fit of "
           "bench/data/h200_llama1b_random.json)", _calibrated_decode),
    Figure("calibration_prefill_8192_ms", _CALIBRATION, _calibration("prefill", ".0f", new=8192)),
    Figure("calibration_prefill_64_after_8192_ms", _CALIBRATION,
           _calibration("prefill_cached", ".1f", cached=8192, new=64)),
    Figure("rates_prefill_us", _RATES, _rate(lambda r: r.prefill_s * 1e6, ".2f")),
    Figure("rates_context_ns", _RATES, _rate(lambda r: r.context_s * 1e9, ".3f")),
    Figure("rates_decode_ns", _RATES, _rate(lambda r: r.decode_s / 2 * 1e9, ".2f")),
    Figure("rates_onboard_gb_s", _RATES, _rate(lambda r: 32768 / r.onboard_s / 1e9, ".0f")),
    Figure("rates_first_ms", _RATES, _rate(lambda r: r.first_s * 1e3, ".0f")),
    Figure("rates_191k_prefill_s", _RATES,
           _rate(lambda r: r.prefill_s * _LONG_PROMPT, ".2f")),
    Figure("rates_191k_attention_s", _RATES,
           _rate(lambda r: r.context_s * _LONG_PROMPT ** 2 / 2, ".0f")),
)


def marked(docs: Path = DOCS) -> list[tuple[Path, str, str]]:
    """Every marked figure in ``docs``: (file, name, value written)."""
    return [(path, m.group(2), m.group(1)) for path in sorted(docs.glob("*.md"))
            for m in _MARK.finditer(path.read_text(encoding="utf-8"))]


def check(docs: Path = DOCS) -> list[str]:
    """What differs between the docs and the figures now, one line each (empty: none)."""
    by_name = {f.name: f for f in FIGURES}
    problems = []
    seen = set()
    for path, name, written in marked(docs):
        seen.add(name)
        figure = by_name.get(name)
        if figure is None:
            problems.append(f"{path.name}: fig:{name} is no figure bench.docs_figures knows")
            continue
        now = figure.compute()
        if now != written:
            problems.append(f"{path.name}: fig:{name} says {written}, {figure.command} "
                            f"prints {now}")
    problems += [f"fig:{f.name} is marked in no doc" for f in FIGURES if f.name not in seen]
    return problems


def write(docs: Path = DOCS) -> int:
    """Put every figure's value now into the docs; returns how many changed."""
    by_name = {f.name: f for f in FIGURES}
    changed = 0
    for path in sorted(docs.glob("*.md")):
        text = path.read_text(encoding="utf-8")

        def now(m: re.Match[str]) -> str:
            figure = by_name.get(m.group(2))
            return m.group(0) if figure is None else f"{figure.compute()}<!-- fig:{m.group(2)} -->"

        new = _MARK.sub(now, text)
        if new != text:
            changed += sum(a != b for a, b in zip(_MARK.findall(text), _MARK.findall(new),
                                                  strict=True))
            path.write_text(new, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    """Print, check or write the docs' quick figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.docs_figures",
                                     description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when a doc's figure differs from its value now")
    mode.add_argument("--write", action="store_true", help="put the values now into the docs")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    if args.write:
        print(f"{write()} figures changed")
        return 0
    for figure in FIGURES:
        print(f"{figure.name}: {figure.compute()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
