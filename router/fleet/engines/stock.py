"""Stock engine servers (vLLM, SGLang, TensorRT-LLM) as kvroute workers.

A stock server has no ``/model_info``: the router learns the model from ``GET /v1/models``
(the entry without a ``parent``; entries with one are LoRA adapters), the block size from the
engine's metrics where it publishes it (vLLM: the ``block_size`` label of
``vllm:cache_config_info``; SGLang: ``sglang:page_size``; TensorRT-LLM:
``trtllm_kv_cache_tokens_per_block``), else from the
worker's configuration, else the router's own (a guess, logged). A configured block size the
engine contradicts is refused, as is one the router's differs from (in
:meth:`~router.fleet.worker_table.WorkerInfo.check_compatible`).

Health is ``GET /health`` answering 200; load is the engine's Prometheus metrics, read on every
poll: running and waiting requests, and KV usage (a fraction) times the engine's KV capacity in
blocks as the blocks held by decoding requests. A metrics answer that does not parse, or lacks
these, makes the worker unhealthy with that reason.

An engine can change under the router (restarted with other flags behind the same address), so
every poll also reads ``/v1/models`` and the reported block size again: a block size other than
the one it was described with makes the worker unhealthy with the reason (its events would no
longer match the index); another model or set of adapters updates its description and the
model table (:class:`~router.fleet.engines.base.WorkerChanged`); a ``/v1/models`` that no longer
reads as one base model makes it unhealthy.

Stock engines publish no instance id and no ``/kv/snapshot``: a restart is seen on the event
stream (its sequence numbers start again at 0, which clears the worker's entries), and history
lost beyond the engine's replay buffer clears the worker's entries to be learnt again. The
worker's tokenizer cannot be asked for an identity either: the router trusts that it was given
the engine's tokenizer folder (``docs/engines.md``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from router.fleet.engines.base import (
    AnswerTooLarge,
    PollFailed,
    WorkerChanged,
    WorkerUnreachable,
    poll_failed,
    read_answer,
)
from router.fleet.engines.prometheus import MetricsError, Samples, parse_metrics
from router.fleet.worker_config import WorkerConfig
from router.fleet.worker_table import IncompatibleWorker, WorkerInfo
from router.routing.load import ReportedLoad

__all__ = ["SGLANG", "TRTLLM", "VLLM", "MetricNames", "StockEngine"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Where one engine keeps what the router reads (names as the engine's sources give them).

    Attributes:
        path: the metrics endpoint.
        running: gauge of requests being executed.
        waiting: gauge of requests queued.
        usage: gauge of the KV cache's used fraction, in [0, 1].
        block_size: reads the engine's block size from a scrape, or ``None``.
        capacity_blocks: reads the engine's KV capacity in blocks given the block size, or 0.
    """

    path: str
    running: str
    waiting: str
    usage: str
    block_size: Callable[[Samples], int | None]
    capacity_blocks: Callable[[Samples, int], int]


#: The largest block size believed from an engine's metrics (tokens): engines use 16 to a few
#: hundred; a larger figure is a broken exposition, not a cache the index could follow.
MAX_REPORTED_BLOCK_SIZE = 1 << 20


def _whole(name: str, value: float, least: int, most: int | None = None) -> int:
    """``value`` as a whole number in ``[least, most]``.

    Raises:
        MetricsError: it is fractional, not finite or out of range.
    """
    if not math.isfinite(value) or not float(value).is_integer() or value < least or (
            most is not None and value > most):
        bound = f"{least}..{most}" if most is not None else f"at least {least}"
        raise MetricsError(f"{name} is {value}, not a whole number {bound}")
    return int(value)


def _label_int(samples: Samples, name: str, label: str, least: int = 0,
               most: int | None = None) -> int | None:
    value = samples.label(name, label)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise MetricsError(f"{name} label {label}={value!r} is not an integer") from None
    return _whole(f"{name} label {label}", number, least, most)


def _gauge_int(samples: Samples, name: str, least: int = 0, most: int | None = None
               ) -> int | None:
    found = samples.named(name)
    value = samples.total(name, required=False)
    return None if value is None else _whole(name, value / len(found), least, most)


#: vLLM (``vllm/v1/metrics/loggers.py``): the cache config is an info gauge whose labels are
#: the engine's ``CacheConfig`` fields.
VLLM = MetricNames(
    path="/metrics",
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    usage="vllm:kv_cache_usage_perc",
    block_size=lambda s: _label_int(s, "vllm:cache_config_info", "block_size", 1,
                                    MAX_REPORTED_BLOCK_SIZE),
    capacity_blocks=lambda s, _: _label_int(s, "vllm:cache_config_info", "num_gpu_blocks") or 0,
)

#: SGLang (``sglang/srt/metrics/collector.py``): recent versions publish their page size as
#: ``sglang:page_size``; older ones do not (give ``block_size`` then). Capacity is in tokens.
SGLANG = MetricNames(
    path="/metrics",
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    usage="sglang:token_usage",
    block_size=lambda s: _gauge_int(s, "sglang:page_size", 1, MAX_REPORTED_BLOCK_SIZE),
    capacity_blocks=lambda s, bs: (_gauge_int(s, "sglang:max_total_num_tokens") or 0) // bs,
)

#: TensorRT-LLM ``trtllm-serve`` (``tensorrt_llm/metrics/collector.py``), on its own path.
TRTLLM = MetricNames(
    path="/prometheus/metrics",
    running="trtllm_num_requests_running",
    waiting="trtllm_num_requests_waiting",
    usage="trtllm_kv_cache_utilization",
    block_size=lambda s: _gauge_int(s, "trtllm_kv_cache_tokens_per_block", 1,
                                    MAX_REPORTED_BLOCK_SIZE),
    capacity_blocks=lambda s, _: _gauge_int(s, "trtllm_kv_cache_max_blocks") or 0,
)


class StockEngine:
    """Adapter for a stock engine server (module docstring).

    Args:
        name: the engine's name in configuration (``vllm``, ``sglang``, ``trtllm``).
        metrics: where the engine keeps its load figures.
    """

    def __init__(self, name: str, metrics: MetricNames) -> None:
        self.name = name
        self.metrics = metrics

    async def describe(self, http: httpx.AsyncClient, worker: WorkerConfig,
                       router_block_size: int) -> WorkerInfo:
        """Read ``/v1/models`` and the metrics (see
        :class:`~router.fleet.engines.base.EngineAdapter`)."""
        models = await self._get_json(http, worker, "/v1/models")
        model, adapters, max_model_len = _read_models(worker.url, models)
        try:
            samples = await self._scrape(http, worker, 5.0)
            reported = self.metrics.block_size(samples)
        except PollFailed as exc:
            raise WorkerUnreachable(f"{worker.url}: {exc}", oversize=exc.oversize) from None
        except MetricsError as exc:
            raise WorkerUnreachable(f"{worker.url}{self.metrics.path}: {exc}") from None
        block_size = _block_size(worker, reported, router_block_size)
        try:
            capacity = self.metrics.capacity_blocks(samples, block_size)
        except MetricsError:
            capacity = 0
        return WorkerInfo(
            url=worker.url, model=model, block_size=block_size,
            tokenizer="", instance_id=f"{self.name}:{worker.url}",
            events_endpoint=worker.events, replay_endpoint=worker.replay,
            max_model_len=max_model_len,
            num_blocks=capacity, lora_adapters=adapters,
            max_num_seqs=worker.max_num_seqs or 0)

    async def poll(self, http: httpx.AsyncClient, worker: WorkerConfig,
                   info: WorkerInfo | None, timeout: float = 2.0) -> ReportedLoad:
        """``GET /health``, then the metrics (see
        :class:`~router.fleet.engines.base.EngineAdapter`)."""
        try:
            health = await read_answer(http, f"{worker.url}/health", timeout=timeout)
        except AnswerTooLarge as exc:
            raise PollFailed(f"health check failed: {exc}", oversize=True) from None
        except httpx.HTTPError as exc:
            raise poll_failed("health check", exc, timeout) from None
        if health.status_code != 200:
            raise PollFailed(f"/health answered {health.status_code}")
        samples = await self._scrape(http, worker, timeout)
        m = self.metrics
        try:
            running = samples.total(m.running) or 0.0
            waiting = samples.total(m.waiting) or 0.0
            usage = (samples.total(m.usage) or 0.0) / len(samples.named(m.usage))
            block_size = m.block_size(samples)
        except MetricsError as exc:
            raise PollFailed(f"{m.path}: {exc}") from None
        if usage > 1.0:
            raise PollFailed(f"{m.path}: {m.usage} is {usage}, not a fraction")
        if info is not None and block_size is not None and block_size != info.block_size:
            raise PollFailed(f"{m.path}: the engine now reports block size {block_size}, not "
                             f"{info.block_size}: its events would no longer match the index")
        blocks = info.num_blocks if info else 0
        load = ReportedLoad(running=int(running), waiting=int(waiting),
                            decode_blocks=usage * blocks, kv_usage=usage)
        if info is not None:
            await self._recheck_models(http, worker, info, timeout, load)
        return load

    async def _recheck_models(self, http: httpx.AsyncClient, worker: WorkerConfig,
                              info: WorkerInfo, timeout: float, load: ReportedLoad) -> None:
        """Raise :class:`WorkerChanged` when ``/v1/models`` no longer says what ``info``
        does, :class:`PollFailed` when it no longer reads as one base model."""
        try:
            body = await self._get_json(http, worker, "/v1/models", timeout)
            model, adapters, max_model_len = _read_models(worker.url, body)
        except WorkerUnreachable as exc:
            late = isinstance(exc.__cause__, httpx.TimeoutException)
            raise PollFailed(str(exc), gone=late, late=late, oversize=exc.oversize) from None
        if (model, adapters, max_model_len) == (info.model, info.lora_adapters,
                                                info.max_model_len):
            return
        was = (info.model, *info.lora_adapters)
        now = (model, *adapters)
        reason = (f"/v1/models changed: {' '.join(was)} -> {' '.join(now)}" if was != now
                  else f"/v1/models changed: max_model_len {info.max_model_len} -> "
                  f"{max_model_len}")
        raise WorkerChanged(reason, dataclasses.replace(
            info, model=model, lora_adapters=adapters, max_model_len=max_model_len), load)

    async def _scrape(self, http: httpx.AsyncClient, worker: WorkerConfig, timeout: float
                      ) -> Samples:
        url = f"{worker.url}{self.metrics.path}"
        try:
            answer = await read_answer(http, url, timeout=timeout)
            answer.raise_for_status(url)
        except AnswerTooLarge as exc:
            raise PollFailed(f"metrics scrape failed: {exc}", oversize=True) from None
        except httpx.HTTPError as exc:
            raise poll_failed("metrics scrape", exc, timeout) from None
        try:
            return parse_metrics(answer.content.decode("utf-8", errors="replace"))
        except MetricsError as exc:
            raise PollFailed(f"{self.metrics.path}: {exc}") from None

    async def _get_json(self, http: httpx.AsyncClient, worker: WorkerConfig, path: str,
                        timeout: float = 5.0) -> Any:
        url = f"{worker.url}{path}"
        try:
            answer = await read_answer(http, url, timeout=timeout)
            answer.raise_for_status(url)
            return json.loads(answer.content)
        except AnswerTooLarge as exc:
            raise WorkerUnreachable(str(exc), oversize=True) from None
        except (httpx.HTTPError, ValueError) as exc:
            raise WorkerUnreachable(f"{worker.url}{path}: {type(exc).__name__}: {exc}"
                                    ) from exc


def _read_models(url: str, body: Any) -> tuple[str, tuple[str, ...], int]:
    """The base model, the LoRA adapters and the context length from ``/v1/models``."""
    data = body.get("data") if type(body) is dict else None
    if type(data) is not list or not data or not all(type(m) is dict for m in data):
        raise WorkerUnreachable(f"{url}/v1/models: no list of models under 'data'")
    ids = [m.get("id") for m in data]
    if not all(type(i) is str and i for i in ids):
        raise WorkerUnreachable(f"{url}/v1/models: a model has no id")
    bases = [m for m in data if m.get("parent") is None]
    if len(bases) != 1:
        raise WorkerUnreachable(f"{url}/v1/models: {len(bases)} base models, expected one")
    base = bases[0]
    length = base.get("max_model_len")
    adapters = tuple(m["id"] for m in data if m is not base)
    return base["id"], adapters, length if type(length) is int and length > 0 else 0


def _block_size(worker: WorkerConfig, reported: int | None, router_block_size: int) -> int:
    if reported is not None and reported <= 0:
        raise WorkerUnreachable(f"{worker.url}: the engine reports block size {reported}")
    if reported is not None and worker.block_size is not None and reported != worker.block_size:
        raise IncompatibleWorker(
            f"worker {worker.url}: the engine reports block size {reported} but its "
            f"configuration says {worker.block_size}; correct the configuration")
    if reported is not None:
        return reported
    if worker.block_size is not None:
        return worker.block_size
    log.warning("worker %s (%s) reports no block size and none is configured: assuming the "
                "router's, %d; set block_size for it to be sure", worker.url, worker.engine,
                router_block_size)
    return router_block_size
