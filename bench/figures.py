"""Benchmark figures: means, percentiles, and printing a run's figures as a table or one JSON
line."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["mean", "percentile", "print_figures"]


def mean(values: Sequence[float]) -> float:
    """Return the arithmetic mean; NaN when empty."""
    return math.fsum(values) / len(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100) by linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def print_figures(figures: Mapping[str, Any], as_json: bool) -> None:
    """Print ``figures`` as one JSON object, or as aligned ``name  value`` lines."""
    if as_json:
        print(json.dumps(dict(figures)))
        return
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")
