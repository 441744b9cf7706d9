"""The router's Prometheus metrics, on a registry of its own (one per app, so tests and
replicas in one process never collide).

Request-path figures are recorded as they happen, each request through a
:class:`RequestTimer`; state (index size, worker states and load, event lag, gaps, replays,
resyncs, malformed input, the pool gauges) is read from the service at scrape time
(:mod:`router.http.state_metrics`). Per-worker families are labelled with the worker's id,
bounded (:mod:`router.http.worker_labels`). No ``_created`` series: they double the series
count and no dashboard reads them.

Cost: the request-path families are :mod:`router.http.tallies` (no locks), so a request's
eight increments and observations cost a few µs; with prometheus_client's ``Counter`` and
``Histogram`` they cost about 45 µs of CPU on the 2-core VM under load (``bench/router.py``'s
docstring has the before and after). The request id of :class:`httpapi.logs.RequestIds` is
about 3 µs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.http.demand_metrics import DemandCollector
from router.http.state_metrics import StateCollector
from router.http.tallies import Count, CountFamily, Tally, TallyFamily
from router.http.tracing import annotate
from router.http.worker_labels import WorkerLabels

if TYPE_CHECKING:
    from router.fleet.entry import Target
    from router.service import Route, RouterService

__all__ = ["RequestTimer", "RouterMetrics"]

disable_created_metrics()

#: Seconds to a stream's first token.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Seconds between a stream's tokens.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
#: Seconds from a request's arrival to the end of its answer.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Seconds from a request's arrival to its first upstream send.
ROUTER_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25)


class _PerWorker(NamedTuple):
    label: str
    ttft: Tally
    itl: Tally
    duration_stream: Tally
    duration_whole: Tally
    #: The worker's children of the counters with more labels, by family and label values.
    counted: dict[tuple[str, ...], Count]


class RouterMetrics:
    """Counters and histograms of the request path, plus a collector of router state."""

    def __init__(self, service: RouterService) -> None:
        self._service = service
        self.registry = r = CollectorRegistry()
        self.requests = CountFamily("kvroute_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.decision = TallyFamily(
            "kvroute_decision_seconds", "Time to tokenize, hash, match and score a request",
            buckets=(25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2),
            registry=r)
        self.before_upstream = TallyFamily(
            "kvroute_router_seconds",
            "Time from a request's arrival to its first upstream send (body, decision, booking)",
            buckets=ROUTER_BUCKETS, registry=r)
        self.predicted = CountFamily("kvroute_predicted_cached_tokens",
                                 "Prompt tokens the router expected cached where it sent them",
                                 registry=r)
        self.reported = CountFamily("kvroute_reported_cached_tokens",
                                "Cached prompt tokens the workers reported for routed requests",
                                registry=r)
        self.prediction_error = TallyFamily(
            "kvroute_cached_tokens_error", "Reported minus predicted cached tokens, per request",
            buckets=(-4096, -1024, -256, -64, -1, 0, 1, 64, 256, 1024, 4096), registry=r)
        self.upstream_failures = CountFamily(
            "kvroute_upstream_failures",
            "Workers that failed before answering (the request went to the next one), by "
            "cause: connect, status (5xx), stream_error, deadline (no first byte in time or "
            "the worker stopped answering its health probe)",
            ["worker", "attempt", "cause"], registry=r)
        self.upstream_requests = CountFamily(
            "kvroute_upstream_requests", "Answers that began from the worker, by status",
            ["worker", "status"], registry=r)
        self.upstream_errors = CountFamily(
            "kvroute_upstream_errors",
            "Worker errors, by cause: the causes of kvroute_upstream_failures, and midstream "
            "(a stream that broke after its first byte)", ["worker", "cause"], registry=r)
        self.ttft = TallyFamily("kvroute_time_to_first_token_seconds",
                              "Time from a streamed request's arrival to its first token",
                              ["worker"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = TallyFamily("kvroute_inter_token_latency_seconds",
                             "Time between a stream's chunks, over the events in the later one",
                             ["worker"], buckets=ITL_BUCKETS, registry=r)
        self.duration = TallyFamily(
            "kvroute_request_duration_seconds",
            "Time from a request's arrival to the end of its answer, streamed or not",
            ["worker", "stream"], buckets=DURATION_BUCKETS, registry=r)
        self._counters = {"kvroute_upstream_failures": self.upstream_failures,
                          "kvroute_upstream_requests": self.upstream_requests,
                          "kvroute_upstream_errors": self.upstream_errors}
        self._workers: WorkerLabels[_PerWorker] = WorkerLabels(self._children, self._forget)
        #: The requests counter's children by endpoint and status (a few dozen at most).
        self._answered: dict[tuple[str, int], Count] = {}
        self.registry.register(StateCollector(service, self._workers.label))
        #: The autoscaling signal (router.http.demand_metrics).
        self.demand = DemandCollector(service)
        self.registry.register(self.demand)

    def _children(self, worker: str) -> _PerWorker:
        return _PerWorker(worker, self.ttft.labels(worker), self.itl.labels(worker),
                          self.duration.labels(worker, "true"),
                          self.duration.labels(worker, "false"), {})

    def _forget(self, worker: str) -> None:
        per = self._workers.get_known(worker)
        for family in (self.ttft, self.itl):
            family.remove(worker)
        for stream in ("true", "false"):
            self.duration.remove(worker, stream)
        for name, *labels in per.counted if per is not None else ():
            self._counters[name].remove(worker, *labels)

    def _count(self, per: _PerWorker, name: str, *labels: str) -> None:
        key = (name, *labels)
        child = per.counted.get(key)
        if child is None:
            child = per.counted[key] = self._counters[name].labels(per.label, *labels)
        child.inc()

    def worker_label(self, worker: int) -> str:
        """``worker``'s ``worker`` label value, the same in every family that has one."""
        return self._workers.label(worker)

    def request(self, endpoint: str, status: int) -> None:
        """Count one answered request."""
        child = self._answered.get((endpoint, status))
        if child is None:
            child = self._answered[endpoint, status] = self.requests.labels(endpoint,
                                                                            str(status))
        child.inc()

    def timer(self, arrived: float) -> RequestTimer:
        """A timer for a request that arrived at ``arrived`` (``time.perf_counter()``)."""
        return RequestTimer(self, arrived)

    def decided(self, route: Route) -> None:
        """Record a routing decision's latency and the cached tokens it expects."""
        self.decision.observe(route.decision_seconds)
        block = self._service.settings.block_size
        self.predicted.inc(route.decision.chosen.matched_blocks * block)
        self.demand.routed(route)
        annotate(route)  # the request's span, when traced (router.http.tracing)

    def reported_cached(self, route: Route, cached_tokens: int) -> None:
        """Record what the worker said was cached, against the prediction."""
        self.reported.inc(cached_tokens)
        block = self._service.settings.block_size
        self.prediction_error.observe(cached_tokens
                                      - route.decision.chosen.matched_blocks * block)

    def upstream_failure(self, worker: Target, attempt: int, cause: str) -> None:
        """Count a worker failing before its first byte."""
        per = self._workers.get(worker.id)
        self._count(per, "kvroute_upstream_failures", str(attempt), cause)
        self._count(per, "kvroute_upstream_errors", cause)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        self._workers.prune(e.id for e in self._service.workers())
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """One request's clock: the time it spent in the router, then its answer's timing.

    Created when the request arrives; :meth:`sending` before the first upstream send,
    :meth:`answered` once a worker began to answer, :meth:`chunk` for each streamed chunk,
    :meth:`done` when the answer ended.
    """

    __slots__ = ("_arrived", "_last", "_metrics", "_per", "_stream")

    def __init__(self, metrics: RouterMetrics, arrived: float) -> None:
        self._metrics = metrics
        self._arrived = arrived
        self._last = 0.0
        self._per: _PerWorker | None = None
        self._stream = False

    def sending(self) -> None:
        """The request is about to go upstream for the first time."""
        self._metrics.before_upstream.observe(time.perf_counter() - self._arrived)

    def answered(self, worker: Target, status: int, stream: bool) -> None:
        """``worker`` began to answer with ``status``."""
        metrics = self._metrics
        self._per = per = metrics._workers.get(worker.id)
        self._stream = stream
        metrics._count(per, "kvroute_upstream_requests", str(status))

    def chunk(self, data: bytes) -> None:
        """A streamed chunk went to the client (the first one times the first token)."""
        per = self._per
        assert per is not None, "chunk() before answered()"
        now = time.perf_counter()
        if not self._last:
            per.ttft.observe(now - self._arrived)
        else:
            per.itl.observe((now - self._last) / max(1, data.count(b"data:")))
        self._last = now

    def done(self, broken: bool = False) -> None:
        """The answer ended (``broken``: a stream that failed after its first byte)."""
        per = self._per
        if per is None:
            return
        duration = per.duration_stream if self._stream else per.duration_whole
        duration.observe(time.perf_counter() - self._arrived)
        if broken:
            self._metrics._count(per, "kvroute_upstream_errors", "midstream")
