"""The lock-free tallies expose exactly what prometheus_client's Counter and Histogram expose
for the same increments and observations, labelled and not, after removals too."""

from __future__ import annotations

import random

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from router.http.tallies import CountFamily, TallyFamily

SIGNED = (-64, -1, 0, 1e-3, 0.25, 1, 64)  # as the cached-tokens error's (no _sum then)
TIMES = (25e-6, 1e-3, 0.25, 1, 64)


def lines(registry: CollectorRegistry) -> list[str]:
    return generate_latest(registry).decode().splitlines()


def test_the_exposition_equals_prometheus_clients() -> None:
    disable_created_metrics()  # as router.http.metrics does (no _created series)
    rng = random.Random(3)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counters = [
        (Counter("c_plain", "a counter", registry=theirs),
         CountFamily("c_plain", "a counter", registry=ours)),
        (Counter("c_labelled", "by worker", ["worker", "cause"], registry=theirs),
         CountFamily("c_labelled", "by worker", ["worker", "cause"], registry=ours)),
    ]
    histograms = [
        (Histogram("h_plain", "a histogram", buckets=TIMES, registry=theirs),
         TallyFamily("h_plain", "a histogram", buckets=TIMES, registry=ours)),
        (Histogram("h_signed", "signed", buckets=SIGNED, registry=theirs),
         TallyFamily("h_signed", "signed", buckets=SIGNED, registry=ours)),
        (Histogram("h_labelled", "by worker", ["worker"], buckets=TIMES, registry=theirs),
         TallyFamily("h_labelled", "by worker", ["worker"], buckets=TIMES, registry=ours)),
    ]
    # values on the bounds themselves too: a bucket counts what is at most its bound
    values = [*SIGNED, *TIMES, 1e9, -1e9] + [rng.uniform(-100, 100) for _ in range(300)]
    for v in values:
        labels = [str(rng.randrange(3)), "deadline"]
        for reference, count in counters:
            n = len(count.labelnames)
            reference.labels(*labels[:n]).inc(abs(v)) if n else reference.inc(abs(v))
            count.labels(*labels[:n]).inc(abs(v))
        for reference, tally in histograms:
            n = len(tally.labelnames)
            reference.labels(*labels[:n]).observe(v) if n else reference.observe(v)
            tally.labels(*labels[:n]).observe(v)
    assert lines(ours) == lines(theirs)
    for reference, family in [counters[1], histograms[2]]:
        args = ["1", "deadline"][: len(family.labelnames)]
        reference.remove(*args)
        family.remove(*args)
        family.remove("no such worker", *args[1:])  # nothing to remove: no error
    assert lines(ours) == lines(theirs)
    assert 'c_labelled_total{cause="deadline",worker="0"} ' in "\n".join(lines(ours))


def test_label_values_must_match_the_names() -> None:
    family = CountFamily("c", "a counter", ["worker"])
    with pytest.raises(ValueError, match="takes 1 label values, got 2"):
        family.labels("a", "b")
    with pytest.raises(ValueError, match="is labelled"):
        family.inc()
    with pytest.raises(ValueError, match="is labelled"):
        TallyFamily("h", "a histogram", ["worker"], buckets=(1,)).observe(0.5)


def test_buckets_must_increase() -> None:
    with pytest.raises(ValueError, match="buckets must increase"):
        TallyFamily("h", "a histogram", buckets=(1, 0.5))
