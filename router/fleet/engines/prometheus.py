"""Reading an engine's Prometheus ``/metrics`` text, which is untrusted input.

The text is parsed with ``prometheus_client``'s parser (the one translation point for its
errors) into :class:`Samples`: every sample's name, labels and value. Anything the parser
refuses, a body past :data:`MAX_METRICS_BYTES`, or a value that is not a finite number where a
gauge is wanted raises :class:`MetricsError`, whose message says what was wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MAX_METRICS_BYTES", "MetricsError", "Sample", "Samples", "parse_metrics"]

#: Largest metrics body read; an engine's is tens of kilobytes.
MAX_METRICS_BYTES = 8 * 1024 * 1024


class MetricsError(ValueError):
    """The metrics text is malformed, too large, or lacks a metric that was needed."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample line: ``name{labels} value``."""

    name: str
    labels: Mapping[str, str]
    value: float


class Samples:
    """The samples of one scrape, looked up by name."""

    def __init__(self, samples: list[Sample]) -> None:
        self._by_name: dict[str, list[Sample]] = {}
        for s in samples:
            self._by_name.setdefault(s.name, []).append(s)

    def named(self, name: str) -> list[Sample]:
        """Every sample called ``name`` (empty when there is none)."""
        return self._by_name.get(name, [])

    def total(self, name: str, *, required: bool = True) -> float | None:
        """The sum of ``name`` over its samples (one per engine core or rank; a server
        serves one model, so its ``model_name`` label does not split them).

        Args:
            name: the sample name.
            required: raise when there is no such sample; else return ``None``.

        Raises:
            MetricsError: no sample (when required), or a value that is negative or not finite.
        """
        found = self.named(name)
        if not found:
            if required:
                raise MetricsError(f"metrics lack {name}")
            return None
        for s in found:
            if not math.isfinite(s.value) or s.value < 0:
                raise MetricsError(f"{name} is {s.value}, not a count or a fraction")
        return sum(s.value for s in found)

    def label(self, name: str, label: str) -> str | None:
        """The ``label`` of the first ``name`` sample that has it (info-style metrics)."""
        return next((s.labels[label] for s in self.named(name) if label in s.labels), None)


def parse_metrics(text: str) -> Samples:
    """Parse Prometheus text exposition.

    Raises:
        MetricsError: the text is too large or does not parse.
    """
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsError(f"metrics answer is {len(text)} bytes, over {MAX_METRICS_BYTES}")
    try:
        samples = [Sample(s.name, dict(s.labels), float(s.value))
                   for family in text_string_to_metric_families(text) for s in family.samples]
    except Exception as exc:  # the parser raises ValueError, KeyError, IndexError, ...
        raise MetricsError(f"metrics do not parse: {type(exc).__name__}: {exc}") from None
    return Samples(samples)
