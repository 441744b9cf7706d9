"""Counts of requests the HTTP server refused before an app saw them whole, for ``/metrics``.

The refusals happen in the connection's protocol or around the app (:mod:`httpapi.server`,
:mod:`httpapi.deadlines`), below any app's own metrics, so they are tallied here, once per
process, and each app's registry reads the tally at scrape time
(:func:`register_refusals`). A process serves one app; tests that start several read
differences.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["REASONS", "count_refusal", "refusals", "register_refusals"]

#: Why a request was refused: its headers passed ``max_header_bytes`` (431), its body did not
#: arrive within ``body_timeout`` or paused longer than ``body_idle_timeout`` (408), its
#: ``Transfer-Encoding`` was not ``chunked`` alone (400).
REASONS = ("headers_too_large", "body_timeout", "body_idle_timeout", "bad_framing")

_TALLY: Counter[str] = Counter()


def count_refusal(reason: str) -> None:
    """Count one refusal for ``reason`` (one of :data:`REASONS`)."""
    assert reason in REASONS, f"unknown refusal reason {reason!r}"
    _TALLY[reason] += 1


def refusals(reason: str) -> int:
    """How many refusals for ``reason`` this process counted."""
    return _TALLY[reason]


class _RefusalCollector:
    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("kvroute_http_refusals",
                                     "Requests refused by the HTTP server before the app read "
                                     "them, by reason", labels=["reason"])
        for reason in REASONS:
            family.add_metric([reason], _TALLY[reason])
        yield family


def register_refusals(registry: CollectorRegistry) -> None:
    """Show the tally as ``kvroute_http_refusals_total{reason=...}`` on ``registry``."""
    registry.register(_RefusalCollector())
