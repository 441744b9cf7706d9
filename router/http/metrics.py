"""The router's Prometheus metrics, on a registry of its own (one per app, so tests and
replicas in one process never collide).

Request-path figures are recorded as they happen; state (index size, worker states, event
lag, gaps, replays, resyncs, malformed input) is read from the service at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.http.tokenize_metrics import tokenize_families

if TYPE_CHECKING:
    from router.fleet.registry import WorkerEntry
    from router.service import Route, RouterService

__all__ = ["RouterMetrics"]

_FEED_COUNTERS = ("batches", "replayed", "gaps", "history_lost", "resyncs", "snapshots", "restarts",
                  "malformed", "snapshot_failures", "feed_failures", "over_capacity")
#: Counters the subscriber keeps itself, with their help texts.
_SUBSCRIBER_COUNTERS = {
    "oversize": "Connections dropped for a message over the event size limit, per worker",
    "replay_retries": "Replays asked again after one that did not cover a gap, per worker",
}


class RouterMetrics:
    """Counters and histograms of the request path, plus a collector of router state."""

    def __init__(self, service: RouterService) -> None:
        self._service = service
        self.registry = CollectorRegistry()
        self.requests = Counter("kvroute_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.decision = Histogram(
            "kvroute_decision_seconds", "Time to tokenize, hash, match and score a request",
            buckets=(25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2),
            registry=self.registry)
        self.predicted = Counter("kvroute_predicted_cached_tokens",
                                 "Prompt tokens the router expected cached where it sent them",
                                 registry=self.registry)
        self.reported = Counter("kvroute_reported_cached_tokens",
                                "Cached prompt tokens the workers reported for routed requests",
                                registry=self.registry)
        self.prediction_error = Histogram(
            "kvroute_cached_tokens_error", "Reported minus predicted cached tokens, per request",
            buckets=(-4096, -1024, -256, -64, -1, 0, 1, 64, 256, 1024, 4096),
            registry=self.registry)
        self.upstream_failures = Counter(
            "kvroute_upstream_failures",
            "Workers that failed before answering (the request went to the next one), by "
            "cause: connect, status (5xx), stream_error, deadline (no first byte in time or "
            "the worker stopped answering its health probe)",
            ["worker", "attempt", "cause"], registry=self.registry)
        self.registry.register(_StateCollector(service))

    def request(self, endpoint: str, status: int) -> None:
        """Count one answered request."""
        self.requests.labels(endpoint, str(status)).inc()

    def decided(self, route: Route) -> None:
        """Record a routing decision's latency and the cached tokens it expects."""
        self.decision.observe(route.decision_seconds)
        block = self._service.settings.block_size
        self.predicted.inc(route.decision.chosen.matched_blocks * block)

    def reported_cached(self, route: Route, cached_tokens: int) -> None:
        """Record what the worker said was cached, against the prediction."""
        self.reported.inc(cached_tokens)
        block = self._service.settings.block_size
        self.prediction_error.observe(cached_tokens
                                      - route.decision.chosen.matched_blocks * block)

    def upstream_failure(self, worker: WorkerEntry, attempt: int, cause: str) -> None:
        """Count a worker failing before its first byte."""
        self.upstream_failures.labels(worker.url, str(attempt), cause).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _StateCollector:
    def __init__(self, service: RouterService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        service = self._service
        entries = service.registry.entries()
        index = GaugeMetricFamily("kvroute_index_blocks", "Distinct blocks in the prefix index")
        index.add_metric([], service.index.num_blocks())
        yield index
        yield from tokenize_families(service.tokenizer)
        states = GaugeMetricFamily("kvroute_workers", "Registered workers by state",
                                   labels=["state"])
        for state in ("healthy", "unhealthy", "incompatible"):
            states.add_metric([state], sum(e.state.value == state for e in entries))
        yield states
        now = time.monotonic()
        pressure = GaugeMetricFamily(
            "kvroute_eviction_pressure",
            "Device blocks the workers removed in the pressure window over their peak resident")
        pressure.add_metric([], service.core.eviction_pressure(now))
        yield pressure
        factor = GaugeMetricFamily("kvroute_rate_factor",
                                   "The worker's learned factor on its engine kind's rates",
                                   labels=["worker"])
        for e in entries:
            factor.add_metric([e.url], service.core.rate_factor(e.id))
        yield factor
        if service.core.follows_sessions:
            live = GaugeMetricFamily("kvroute_sessions",
                                     "Live chat or agent sessions homed on the worker",
                                     labels=["worker"])
            for e in entries:
                live.add_metric([e.url], service.core.live_sessions(e.id))
            yield live
            rate = GaugeMetricFamily(
                "kvroute_session_continue_rate",
                "Share of routed requests a next turn followed (rather than expired)")
            rate.add_metric([], service.core.continue_rate)
            yield rate
        lag = GaugeMetricFamily("kvroute_event_lag_seconds",
                                "Now minus the timestamp of the worker's latest event batch",
                                labels=["worker"])
        for e in entries:
            if e.feed is not None:
                lag.add_metric([e.url], e.feed.last_lag)
        yield lag
        health = CounterMetricFamily(
            "kvroute_health_failures",
            "Health polls that failed (no answer in time, error status, malformed answer)",
            labels=["worker"])
        for e in entries:
            health.add_metric([e.url], e.counters.get("health_failures", 0))
        yield health
        oversize = CounterMetricFamily(
            "kvroute_control_answers_oversize",
            "Control-plane answers (model info, load, models, health, metrics) refused for "
            "passing the size limit, per worker", labels=["worker"])
        for e in entries:
            oversize.add_metric([e.url], e.counters.get("oversize_answers", 0))
        yield oversize
        predicted = GaugeMetricFamily(
            "kvroute_predicted_blocks",
            "Blocks the router predicts resident without an event saying so yet",
            labels=["worker"])
        for e in entries:
            predicted.add_metric([e.url], service.core.predicted_blocks(e.id))
        yield predicted
        for name in _FEED_COUNTERS:
            family = CounterMetricFamily(f"kvroute_events_{name}",
                                         f"Event stream {name.replace('_', ' ')}, per worker",
                                         labels=["worker"])
            for e in entries:
                family.add_metric([e.url], e.counters.get(name, 0))
            yield family
        for name, text in _SUBSCRIBER_COUNTERS.items():
            family = CounterMetricFamily(f"kvroute_events_{name}", text, labels=["worker"])
            for e in entries:
                if e.feed is not None:
                    family.add_metric([e.url], getattr(e.feed.subscriber.stats, name))
            yield family
