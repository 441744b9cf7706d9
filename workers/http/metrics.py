"""The worker's Prometheus metrics, on a registry of its own; state is read at scrape time.
No ``_created`` series (as on the router)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from workers.http.dialects import MessagesReply, ResponsesReply
    from workers.http.openai_format import Completion
    from workers.runtime import WorkerRuntime

__all__ = ["WorkerMetrics"]

disable_created_metrics()

#: The load figures exported as they are on ``GET /load``.
_LOAD = ("running", "waiting", "pending_prefill_tokens", "kv_usage")


class WorkerMetrics:
    """Request counters plus a collector of engine, cache and event-sink state."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvroute_worker_requests", "Requests accepted, by endpoint",
                                ["endpoint"], registry=self.registry)
        self.refused = Counter("kvroute_worker_refused", "Requests refused, by status",
                               ["status"], registry=self.registry)
        self.image_limits = Counter(
            "kvroute_worker_image_limits",
            "Requests refused by an image fan-out limit, by the setting that refused them",
            ["limit"], registry=self.registry)
        self.prompt_tokens = Counter("kvroute_worker_prompt_tokens", "Prompt tokens served",
                                     registry=self.registry)
        self.cached_tokens = Counter("kvroute_worker_cached_tokens",
                                     "Prompt tokens served from the prefix cache",
                                     registry=self.registry)
        self.generated_tokens = Counter("kvroute_worker_generated_tokens", "Tokens generated",
                                        registry=self.registry)
        self.transferred_tokens = Counter(
            "kvroute_worker_transferred_tokens",
            "Prompt tokens whose KV came from a prefill worker (disaggregated serving)",
            registry=self.registry)
        self.transfer_failures = Counter(
            "kvroute_worker_kv_transfer_failures",
            "KV transfers from a prefill worker that failed (the prompt was prefilled here)",
            registry=self.registry)
        # Peer KV fetch (docs/kv_transfer.md): this worker as receiver, then as holder.
        self.kv_fetch = Counter(
            "kvroute_worker_kv_fetch",
            "Fetch instructions by outcome: fetched, skipped (every named block was here), "
            "failed (the prompt was computed here)", ["outcome"], registry=self.registry)
        self.kv_fetch_blocks = Counter("kvroute_worker_kv_fetch_blocks",
                                       "Blocks taken from peers by fetches",
                                       registry=self.registry)
        self.kv_fetch_seconds = Histogram(
            "kvroute_worker_kv_fetch_seconds", "Seconds from a fetch's start to its blocks "
            "being in the cache, fetches that took blocks",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0), registry=self.registry)
        self.kv_fetch_transfers = Counter(
            "kvroute_worker_kv_fetch_transfers",
            "Fetches that took blocks, by how they moved: http (bytes in the answer), cuda_ipc "
            "(copied device to device from a holder on the same GPU)", ["transfer"],
            registry=self.registry)
        self.kv_ipc_fallbacks = Counter(
            "kvroute_worker_kv_ipc_fallbacks",
            "Fetches that left the CUDA IPC path for HTTP, by reason (status_<code>, "
            "bad_message, open_failed, new_pool)", ["reason"], registry=self.registry)
        self.kv_reads = Counter(
            "kvroute_worker_kv_reads",
            "Block reads by peers, by outcome: served (some blocks sent), missing (none "
            "held), refused (auth, a bad body, every read slot busy, or no room to pin the "
            "blocks held)", ["outcome"],
            registry=self.registry)
        for outcome in ("fetched", "skipped", "failed"):
            self.kv_fetch.labels(outcome)
        for transfer in ("http", "cuda_ipc"):
            self.kv_fetch_transfers.labels(transfer)
        for outcome in ("served", "missing", "refused"):
            self.kv_reads.labels(outcome)
        self.registry.register(_EngineCollector(runtime))

    def finished(self, reply: Completion | ResponsesReply | MessagesReply, generated: int
                 ) -> None:
        """Count a request served to its end."""
        self.prompt_tokens.inc(reply.prompt_tokens)
        self.cached_tokens.inc(reply.cached_tokens)
        self.generated_tokens.inc(generated)


class _EngineCollector:
    def __init__(self, runtime: WorkerRuntime) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        load = self._runtime.engine.load()
        for name in _LOAD:
            gauge = GaugeMetricFamily(f"kvroute_worker_{name}", f"Engine {name}")
            gauge.add_metric([], float(load.get(name, 0)))
            yield gauge
        for name, value in self._runtime.engine.stats().items():
            # The statistics repeat some load figures: one family per name.
            if name in _LOAD:
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                # Engine statistics mix running totals and levels; exported as gauges, the
                # type that is right for both when read at scrape time.
                gauge = GaugeMetricFamily(f"kvroute_worker_{name}", f"Engine statistic {name}")
                gauge.add_metric([], float(value))
                yield gauge
