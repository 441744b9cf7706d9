"""The router's request-path metrics against real HTTP peers on 127.0.0.1: per-worker answers,
errors and timings, the pool gauges, bounded worker labels, and no ``_created`` series.

The router here waits a minute for a stream's first byte and half a minute for a health probe
(:data:`PATIENT`): the counts asserted are of answers, and a loaded machine that stalls a
scripted worker for two seconds must not turn one into a first-byte timeout or a late probe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from router.http.worker_labels import OTHER, WorkerLabels
from tests.router.test_router_service import BODY, router_for
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker

#: Router settings with no deadline a stalled machine could reach (module docstring).
PATIENT = {"first_byte_floor": 60.0, "health_timeout": 30.0}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], metric: str,
          **labels: str) -> float:
    return found.get((metric, frozenset(labels.items())), 0.0)


async def test_streamed_and_whole_answers_are_timed_and_counted_per_worker() -> None:
    async with ScriptedWorker() as worker, router_for(worker, ready=1, **PATIENT) as client:
        worker.load_answer = b'{"running": 1, "waiting": 3, "kv_usage": 0.25}'
        streamed = await client.post("/v1/completions", json={**BODY, "stream": True})
        whole = await client.post("/v1/completions", json=BODY)
        # the next health poll carries the load above; wait for the pool gauges to show it
        text = (await eventually(
            lambda: client.get("/metrics"), "the pool gauges showing the polled load",
            until=lambda r: 'inference_pool_average_queue_size{name="kvroute"} 3.0' in r.text,
        )).text
    assert streamed.status_code == whole.status_code == 200
    wid = streamed.headers["x-kvroute-worker-id"]
    found = samples(text)
    assert value(found, "kvroute_upstream_requests_total", worker=wid, status="200") == 2
    assert value(found, "kvroute_time_to_first_token_seconds_count", worker=wid) == 1
    assert value(found, "kvroute_request_duration_seconds_count", worker=wid,
                 stream="true") == 1
    assert value(found, "kvroute_request_duration_seconds_count", worker=wid,
                 stream="false") == 1
    assert value(found, "kvroute_router_seconds_count") == 2
    assert value(found, "kvroute_requests_in_flight", worker=wid) == 0
    assert value(found, "kvroute_upstream_info", worker=wid, url=worker.url, engine="kvroute") == 1
    assert value(found, "inference_pool_ready_pods", name="kvroute") == 1
    assert value(found, "inference_pool_average_queue_size", name="kvroute") == 3
    assert value(found, "inference_pool_average_kv_cache_utilization", name="kvroute") == 0.25
    assert "_created" not in text


async def test_errors_are_counted_per_worker_by_cause() -> None:
    async with (
        ScriptedWorker("refuse") as bad,
        ScriptedWorker("die_mid_stream") as broken,
        router_for(bad, broken, ready=2, **PATIENT) as client,
    ):
        for i in range(6):
            await client.post("/v1/completions",
                              json={**BODY, "prompt": f"request {i} " * 20, "stream": True})
        workers = {w["url"]: str(w["id"]) for w in (await client.get("/workers")).json()["workers"]}
        found = samples((await client.get("/metrics")).text)
    bad_id, broken_id = workers[bad.url], workers[broken.url]
    refused = value(found, "kvroute_upstream_errors_total", worker=bad_id, cause="status")
    assert refused == len(bad.requests) >= 1
    assert value(found, "kvroute_upstream_errors_total", worker=broken_id,
                 cause="midstream") == 6
    assert value(found, "kvroute_upstream_requests_total", worker=broken_id, status="200") == 6
    assert value(found, "kvroute_upstream_requests_total", worker=bad_id, status="503") == 0


def test_worker_labels_past_the_bound_share_other_and_pruned_ones_drop_their_series() -> None:
    registry = CollectorRegistry()
    family = Histogram("h", "h", ["worker"], registry=registry)
    labels: WorkerLabels[Histogram] = WorkerLabels(family.labels, family.remove, limit=2)
    for worker in range(4):
        labels.get(worker).observe(1.0)
    counts = {s.labels["worker"]: s.value for s in registry.collect().__next__().samples
              if s.name == "h_count"}
    assert counts == {"0": 1.0, "1": 1.0, OTHER: 2.0}
    labels.prune([1, 3])  # worker 0 left; 3 still shares "other"
    counts = {s.labels["worker"]: s.value for s in registry.collect().__next__().samples
              if s.name == "h_count"}
    assert counts == {"1": 1.0, OTHER: 2.0}
    assert labels.get(4) is not labels.get(3)  # the place worker 0 left goes to the next one
    assert labels.get(5) is labels.get(3)
    assert labels.get_known("0") is None
