"""Counters and histograms for the request path, without prometheus_client's locks, exported
through a collector at scrape time.

prometheus_client takes a lock on every increment and walks a histogram's buckets in Python:
about 3 µs an increment and 7 µs an observation on the 2-core VM under load, and a request
makes eight of them. The router records its request path on the event loop alone (a thread
that tokenizes a long prompt records nothing), so a plain slot increment is enough:
:class:`Tally` (a histogram) and :class:`Count` (a counter) cost a fraction of a µs. Their
families, :class:`TallyFamily` and :class:`CountFamily`, take the same ``labels`` and
``remove`` calls as prometheus_client's and expose the same series: a family registered on a
``CollectorRegistry`` yields ``NAME_total`` for a counter and ``NAME_bucket`` (cumulative,
``le`` up to ``+Inf``), ``NAME_count`` and ``NAME_sum`` for a histogram (no ``NAME_sum`` when a
bucket is negative, as prometheus_client), one sample set per label values; an unlabelled
family always has its one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

__all__ = ["Count", "CountFamily", "Tally", "TallyFamily"]


class Count:
    """A counter's value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (not negative)."""
        self.value += amount


class Tally:
    """A histogram's buckets and sum; bucket ``i`` counts observations at most
    ``bounds[i]`` and above the bound before it, the last one those above every bound."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family:
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Count | Tally] = {}
        #: An unlabelled family's one series (None when labelled).
        self._only: Count | Tally | None = None
        if not self.labelnames:
            self._only = self._children[()] = self._new()
        if registry is not None:
            registry.register(self)

    def _new(self) -> Count | Tally:
        raise NotImplementedError

    def _child(self, values: tuple[str, ...]) -> Count | Tally:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes {len(self.labelnames)} label values, "
                             f"got {len(values)}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._new()
        return child

    def remove(self, *values: str) -> None:
        """Drop the series of ``values`` (nothing when there is none)."""
        self._children.pop(values, None)

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError

    def describe(self) -> Iterator[Metric]:
        return iter(())


class CountFamily(_Family):
    """Counters by label values, as prometheus_client's ``Counter``."""

    def _new(self) -> Count:
        return Count()

    def labels(self, *values: str) -> Count:
        """The counter of ``values`` (made at first use)."""
        child = self._child(values)
        assert isinstance(child, Count)
        return child

    def inc(self, amount: float = 1.0) -> None:
        """Add to an unlabelled family's counter."""
        only = self._only
        if only is None:
            raise ValueError(f"{self.name} is labelled: inc() through labels()")
        only.inc(amount)  # type: ignore[union-attr]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            assert isinstance(child, Count)
            family.add_metric(values, child.value)
        yield family


class TallyFamily(_Family):
    """Histograms by label values, as prometheus_client's ``Histogram``.

    Args:
        buckets: the finite upper bounds, increasing (``+Inf`` is added).
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float], registry: CollectorRegistry | None = None
                 ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"{name}: buckets must increase, got {buckets}")
        self.bounds = bounds
        self._les = [floatToGoString(b) for b in bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> Tally:
        return Tally(self.bounds)

    def labels(self, *values: str) -> Tally:
        """The histogram of ``values`` (made at first use)."""
        child = self._child(values)
        assert isinstance(child, Tally)
        return child

    def observe(self, value: float) -> None:
        """Observe into an unlabelled family's histogram."""
        only = self._only
        if only is None:
            raise ValueError(f"{self.name} is labelled: observe() through labels()")
        only.observe(value)  # type: ignore[union-attr]

    def collect(self) -> Iterator[Metric]:
        # Built by hand, as prometheus_client's Histogram writes it: with a negative bucket,
        # _count but no _sum (HistogramMetricFamily would leave out both).
        family = Metric(self.name, self.documentation, "histogram")
        name = self.name
        for values, child in list(self._children.items()):
            assert isinstance(child, Tally)
            labels = dict(zip(self.labelnames, values, strict=True))
            cumulative = 0
            for le, count in zip(self._les, child.counts, strict=True):
                cumulative += count
                family.add_sample(f"{name}_bucket", {**labels, "le": le}, float(cumulative))
            family.add_sample(f"{name}_count", labels, float(cumulative))
            if self.bounds[0] >= 0:
                family.add_sample(f"{name}_sum", labels, child.sum)
        yield family
