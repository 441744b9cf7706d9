"""Every family labelled ``worker`` stays within the bound on a fleet past it: the request
families, the ones read from state at scrape time and flow control's saturation label one
worker the same way, and the workers past the bound share ``other``."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from router.fleet.worker_table import WorkerInfo
from router.http.flow import FlowControl
from router.http.flow_metrics import register_flow_metrics
from router.http.metrics import RouterMetrics
from router.http.worker_labels import MAX_WORKER_LABELS, OTHER
from router.routing.admission import FlowSettings
from router.service import RouterService
from router.settings import RouterSettings

FLEET = MAX_WORKER_LABELS + 44


Samples = list[tuple[str, Sample]]


def samples(text: str) -> Samples:
    """Every sample of a scrape with its family's name, parsed once (the fleet's scrape is
    about 20,000 samples)."""
    return [(f.name, s) for f in text_string_to_metric_families(text) for s in f.samples]


def worker_labels(scrape: Samples) -> dict[str, set[str]]:
    """The ``worker`` label values of each family that has the label."""
    found: dict[str, set[str]] = {}
    for family, s in scrape:
        if "worker" in s.labels:
            found.setdefault(family, set()).add(s.labels["worker"])
    return found


def sample(scrape: Samples, family: str, worker: str) -> float:
    return next(s.value for name, s in scrape
                if name == family and s.labels.get("worker") == worker
                and not s.name.endswith("_created"))


async def test_a_fleet_past_the_bound_exports_at_most_the_bound_plus_other_per_family() -> None:
    async with httpx.AsyncClient() as http:
        service = RouterService(RouterSettings(seed=1), http)
        entries = [service.registry.adopt(WorkerInfo(
            url=f"http://w{w}", model="m", block_size=32, tokenizer="bytes-v1",
            instance_id=f"i{w}", max_model_len=1 << 16)) for w in range(FLEET)]
        metrics = RouterMetrics(service)
        flow = FlowControl(FlowSettings(), service.decide_again)
        register_flow_metrics(metrics.registry, flow, metrics.worker_label)
        for e in entries:
            e.counters["health_failures"] = 1
            flow.saturated[e.id] = e.id == entries[-1].id  # only the last one, past the bound
        # the request path meets the workers in reverse: the labels are given at the first
        # scrape, in registry order, and the request families follow them
        metrics.render()
        for e in reversed(entries):
            timer = metrics.timer(time.perf_counter())
            timer.answered(e, 200, stream=False)
            timer.done()
        scrape = samples(metrics.render()[0].decode())

        labels = worker_labels(scrape)
        own = {str(e.id) for e in entries[:MAX_WORKER_LABELS]}
        for family in ("kvroute_health_failures", "kvroute_requests_in_flight",
                       "kvroute_rate_factor", "kvroute_predicted_blocks",
                       "kvroute_upstream_requests", "kvroute_request_duration_seconds",
                       "kvroute_flow_saturated"):
            assert labels[family] == own | {OTHER}, family
        assert all(len(values) <= MAX_WORKER_LABELS + 1 for values in labels.values()), {
            name: len(values) for name, values in labels.items()}
        assert labels["kvroute_upstream_info"] == own | {OTHER}
        info = [s.labels for name, s in scrape
                if name == "kvroute_upstream_info" and s.labels["worker"] == OTHER]
        assert info == [{"worker": OTHER, "url": OTHER, "engine": OTHER}]  # one row for them
        past = FLEET - MAX_WORKER_LABELS
        assert sample(scrape, "kvroute_health_failures", OTHER) == past  # summed
        assert sample(scrape, "kvroute_upstream_requests", OTHER) == past
        assert sample(scrape, "kvroute_rate_factor", OTHER) == 1.0  # averaged, not summed
        assert sample(scrape, "kvroute_flow_saturated", OTHER) == 1.0  # any of them
        assert sample(scrape, "kvroute_flow_saturated", str(entries[0].id)) == 0.0

        # Unregistered workers give their places back at the next scrape; the workers that
        # shared "other" take them, everywhere at once.
        for e in entries[:10]:
            await service.registry.remove(e.id)
        scrape = samples(metrics.render()[0].decode())
        labels = worker_labels(scrape)
        moved = {str(e.id) for e in entries[MAX_WORKER_LABELS:MAX_WORKER_LABELS + 10]}
        assert moved <= labels["kvroute_health_failures"]
        assert moved <= labels["kvroute_upstream_info"]
        assert not {str(e.id) for e in entries[:10]} & set().union(*labels.values())
        assert sample(scrape, "kvroute_health_failures", OTHER) == past - 10
        assert all(len(values) <= MAX_WORKER_LABELS + 1 for values in labels.values())
