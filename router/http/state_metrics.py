"""The router's metrics read from its state at scrape time: the index, the workers' states and
load, the event feeds, and the pool gauges under the Gateway API Inference Extension's names.

Every per-worker family is labelled ``worker`` by the request metrics' labelling
(:meth:`router.http.worker_labels.WorkerLabels.label`): the worker's id, or ``other`` for the
workers past the bound, whose values are combined (counters and counts summed, the rate factor
averaged, the event lag the worst). ``kvroute_upstream_info{worker, url, engine}`` (always 1)
names the worker behind each id, and has one row with ``url`` and ``engine`` ``other`` for the
workers sharing that label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.http.tokenize_metrics import tokenize_families
from router.http.worker_labels import OTHER
from router.routing.fetch_links import FETCH_FAILURES

if TYPE_CHECKING:
    from router.fleet.entry import WorkerEntry
    from router.service import RouterService

__all__ = ["POOL_NAME", "StateCollector"]

#: The ``name`` label of the ``inference_pool_*`` gauges (GIE labels them with the
#: InferencePool's name; a router fronts one pool).
POOL_NAME = "kvroute"

_FEED_COUNTERS = ("batches", "replayed", "gaps", "history_lost", "resyncs", "snapshots", "restarts",
                  "malformed", "snapshot_failures", "feed_failures", "over_capacity")
#: Counters the subscriber keeps itself, with their help texts.
_SUBSCRIBER_COUNTERS = {
    "oversize": "Connections dropped for a message over the event size limit, per worker",
    "replay_retries": "Replays asked again after one that did not cover a gap, per worker",
}


class StateCollector:
    """A Prometheus collector over a :class:`~router.service.RouterService`'s state."""

    def __init__(self, service: RouterService, label: Callable[[int], str]) -> None:
        """``label``: a worker id's ``worker`` label value (the request metrics' own)."""
        self._service = service
        self._label = label

    def collect(self) -> Iterator[Metric]:
        """Yield every state family, read now."""
        service = self._service
        entries = service.workers()
        info = GaugeMetricFamily("kvroute_upstream_info",
                                 "The URL and engine of each registered worker id (always 1)",
                                 labels=["worker", "url", "engine"])
        shared = False
        for e in entries:
            label = self._label(e.id)
            if label != OTHER:
                info.add_metric([label, e.url, e.engine], 1)
            shared = shared or label == OTHER
        if shared:  # one row, so that joins on it keep the shared series
            info.add_metric([OTHER, OTHER, OTHER], 1)
        yield info
        index = GaugeMetricFamily("kvroute_index_blocks", "Distinct blocks in the prefix index")
        index.add_metric([], service.index.num_blocks())
        yield index
        yield from tokenize_families(service.tokenizer)
        states = GaugeMetricFamily("kvroute_workers", "Registered workers by state",
                                   labels=["state"])
        for state in ("healthy", "unhealthy", "incompatible"):
            states.add_metric([state], sum(e.state.value == state for e in entries))
        yield states
        core = service.core
        per_worker = _PerWorker(entries, self._label)
        yield per_worker(GaugeMetricFamily, "kvroute_requests_in_flight",
                         "Requests this router has in flight on the worker",
                         lambda e: core.in_flight(e.id))
        yield from _pool(service)
        now = time.monotonic()
        pressure = GaugeMetricFamily(
            "kvroute_eviction_pressure",
            "Device blocks the workers removed in the pressure window over their peak resident")
        pressure.add_metric([], service.core.eviction_pressure(now))
        yield pressure
        prefills = CounterMetricFamily(
            "kvroute_pd_prefills",
            "Disaggregated serving: requests prefilled on a prefill worker (remote), on their "
            "decode worker because it held most of the prompt (local), or served whole on it "
            "after the prefill failed (failed); sent to another decode worker with a fresh "
            "prefill after one failed before its first byte (retried); served whole after "
            "every decode with the transferred KV failed (whole)", labels=["outcome"])
        for outcome, name in (("remote", "pd_remote_prefills"), ("local", "pd_local_prefills"),
                              ("failed", "pd_prefill_failures"), ("retried", "pd_decode_retries"),
                              ("whole", "pd_served_whole")):
            prefills.add_metric([outcome], service.counters.get(name, 0))
        yield prefills
        counters = service.counters
        decisions = CounterMetricFamily(
            "kvroute_fetch_decisions",
            "Peer fetch: requests sent with an instruction to fetch the prompt's leading "
            "blocks from a peer")
        decisions.add_metric([], counters.get("fetch_decisions", 0))
        yield decisions
        results = CounterMetricFamily(
            "kvroute_fetch_results",
            "Peer fetch: the results instructed workers answered (fetched, failed: the "
            "worker recomputed; malformed: an answer header the router could not read)",
            labels=["outcome"])
        for outcome in ("fetched", "failed", "malformed"):
            results.add_metric([outcome], counters.get(
                "fetch_results_malformed" if outcome == "malformed" else f"fetch_{outcome}", 0))
        yield results
        failures = CounterMetricFamily(
            "kvroute_fetch_failures",
            "Peer fetch: failed results by the worker's reason (missing, evicted, "
            "no_free_blocks back no link off; the others back the pair off)",
            labels=["reason"])
        for reason in FETCH_FAILURES:
            failures.add_metric([reason], counters.get(f"fetch_failed_{reason}", 0))
        yield failures
        fetched = CounterMetricFamily("kvroute_fetch_bytes",
                                      "Peer fetch: KV bytes the instructed workers fetched")
        fetched.add_metric([], counters.get("fetch_bytes", 0))
        yield fetched
        yield per_worker(GaugeMetricFamily, "kvroute_rate_factor",
                         "The worker's learned factor on its engine kind's rates",
                         lambda e: core.rate_factor(e.id), combine=_mean)
        if core.follows_sessions:
            yield per_worker(GaugeMetricFamily, "kvroute_sessions",
                             "Live chat or agent sessions homed on the worker",
                             lambda e: core.live_sessions(e.id))
            rate = GaugeMetricFamily(
                "kvroute_session_continue_rate",
                "Share of routed requests a next turn followed (rather than expired)")
            rate.add_metric([], service.core.continue_rate)
            yield rate
        yield per_worker(GaugeMetricFamily, "kvroute_event_lag_seconds",
                         "Now minus the timestamp of the worker's latest event batch",
                         lambda e: None if e.feed is None else e.feed.last_lag, combine=max)
        yield per_worker(CounterMetricFamily, "kvroute_health_failures",
                         "Health polls that failed (no answer in time, error status, malformed "
                         "answer)", _counted("health_failures"))
        yield per_worker(CounterMetricFamily, "kvroute_control_answers_oversize",
                         "Control-plane answers (model info, load, models, health, metrics) "
                         "refused for passing the size limit, per worker",
                         _counted("oversize_answers"))
        yield per_worker(GaugeMetricFamily, "kvroute_predicted_blocks",
                         "Blocks the router predicts resident without an event saying so yet",
                         lambda e: core.predicted_blocks(e.id))
        for name in _FEED_COUNTERS:
            yield per_worker(CounterMetricFamily, f"kvroute_events_{name}",
                             f"Event stream {name.replace('_', ' ')}, per worker",
                             _counted(name))
        for name, text in _SUBSCRIBER_COUNTERS.items():
            yield per_worker(CounterMetricFamily, f"kvroute_events_{name}", text,
                             _subscriber_stat(name))


def _counted(name: str) -> Callable[[WorkerEntry], float]:
    """A worker's counter ``name`` (0 until it first counts)."""
    return lambda e: e.counters.get(name, 0)


def _subscriber_stat(name: str) -> Callable[[WorkerEntry], float | None]:
    """A worker's subscriber statistic ``name`` (None while it has no feed)."""
    return lambda e: None if e.feed is None else getattr(e.feed.subscriber.stats, name)


class _PerWorker:
    """Builds the families labelled ``worker`` over one scrape's workers."""

    def __init__(self, entries: list[WorkerEntry], label: Callable[[int], str]) -> None:
        self._entries = entries
        self._label = label

    def __call__(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                 text: str, value: Callable[[WorkerEntry], float | None],
                 combine: Callable[[list[float]], float] = sum) -> Metric:
        """One family: ``value(entry)`` for each worker, leaving out those it gives None for,
        and ``combine`` over the values of the workers that share a label."""
        family = kind(name, text, labels=["worker"])
        by_label: dict[str, list[float]] = {}
        for e in self._entries:
            v = value(e)
            if v is not None:
                by_label.setdefault(self._label(e.id), []).append(v)
        for key, values in by_label.items():
            family.add_metric([key], values[0] if len(values) == 1 else combine(values))
        return family


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _pool(service: RouterService) -> Iterator[Metric]:
    # GIE's pool gauges: ready endpoints, and the mean over them of the KV cache in use (a
    # fraction) and of the queued requests, as each worker last reported them.
    ready = service.candidates()
    reports = [r for r in (service.core.last_report(e.id) for e in ready) if r is not None]
    yield _pool_gauge("inference_pool_ready_pods",
                      "Workers in the pool that may take a request", len(ready))
    yield _pool_gauge("inference_pool_average_kv_cache_utilization",
                      "Mean KV cache use (a fraction) over the ready workers",
                      _mean([r.kv_usage for r in reports]) if reports else 0.0)
    yield _pool_gauge("inference_pool_average_queue_size",
                      "Mean requests waiting in the ready workers' queues",
                      _mean([r.waiting for r in reports]) if reports else 0.0)


def _pool_gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    """One of GIE's pool gauges: ``value``, labelled with the pool's name."""
    gauge = GaugeMetricFamily(name, documentation, labels=["name"])
    gauge.add_metric([POOL_NAME], value)
    return gauge
