"""Flow control's metrics (:mod:`router.http.flow`): the queue's length and each request's
wait by priority and tenant, refusals by reason, priority and tenant, and each worker's
saturation as the last decision saw it.

Every label set is bounded whatever clients send: priorities by
:func:`~router.routing.admission.priority_label` (``-10`` .. ``10``, else ``high`` or
``low``), tenants by :meth:`~router.routing.admission.FlowSettings.tenant_label` (a tenant
named in the weights is its own label, every other one is ``other``), workers as every
per-worker family is (:meth:`router.http.metrics.RouterMetrics.worker_label`: the id, or
``other`` past the bound, saturated when any worker sharing it is).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.routing.admission import SHED_REASONS, priority_label

if TYPE_CHECKING:
    from router.http.flow import FlowControl

__all__ = ["register_flow_metrics"]

_WAIT_BUCKETS = (1e-3, 5e-3, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def register_flow_metrics(registry: CollectorRegistry, flow: FlowControl,
                          worker_label: Callable[[int], str]) -> None:
    """Export ``flow``'s queue, waits, refusals and saturation on ``registry``, labelling
    workers with ``worker_label``."""
    wait = Histogram(
        "kvroute_flow_wait_seconds",
        "Seconds a request waited in the router's queue for a saturated fleet, by priority "
        "and tenant", ["priority", "tenant"], buckets=_WAIT_BUCKETS, registry=registry)
    tenant_label = flow.settings.tenant_label
    flow.on_wait = lambda priority, tenant, seconds: wait.labels(
        priority_label(priority), tenant_label(tenant)).observe(seconds)
    registry.register(_FlowCollector(flow, worker_label))


class _FlowCollector:
    def __init__(self, flow: FlowControl, worker_label: Callable[[int], str]) -> None:
        self._flow = flow
        self._worker_label = worker_label

    def collect(self) -> Iterator[Metric]:
        flow = self._flow
        tenant_label = flow.settings.tenant_label
        queued = GaugeMetricFamily("kvroute_flow_queued",
                                   "Requests waiting in the router's queue, by priority and "
                                   "tenant", labels=["priority", "tenant"])
        lengths: Counter[tuple[str, str]] = Counter()
        for (priority, tenant), n in flow.queue.counts().items():
            lengths[priority_label(priority), tenant_label(tenant)] += n
        for (priority_l, tenant_l), n in sorted(lengths.items()):
            queued.add_metric([priority_l, tenant_l], n)
        yield queued
        shed = CounterMetricFamily(
            "kvroute_flow_shed",
            f"Requests flow control refused (429), by reason ({', '.join(SHED_REASONS)}), "
            "priority and tenant", labels=["reason", "priority", "tenant"])
        for key, count in sorted(flow.shed.items()):  # kept by its labels
            shed.add_metric(list(key), count)
        yield shed
        saturated = GaugeMetricFamily(
            "kvroute_flow_saturated",
            "1 when the worker was saturated, or at its limit of sequences, as the last "
            "decision that looked at it saw it",
            labels=["worker"])
        by_label: dict[str, bool] = {}
        for worker, full in sorted(flow.saturated.items()):
            label = self._worker_label(worker)
            by_label[label] = by_label.get(label, False) or full
        for label, full in by_label.items():
            saturated.add_metric([label], float(full))
        yield saturated
