"""Probes of a stock engine's ``/metrics`` text as the router reads it (vLLM's, SGLang's,
TensorRT-LLM's names): malformed exposition, huge bodies, NaN and infinities, negative and
zero counts, block sizes and capacities that cannot be. For every probe the reading is a
sane value or :class:`~router.fleet.engines.prometheus.MetricsError` with a message, never
another exception."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from router.fleet.engines.prometheus import MAX_METRICS_BYTES, MetricsError, parse_metrics
from router.fleet.engines.stock import SGLANG, TRTLLM, VLLM, MetricNames

GOOD_VLLM = (
    'vllm:num_requests_running{model_name="m"} 2\n'
    'vllm:num_requests_waiting{model_name="m"} 1\n'
    'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1\n')


def read(names: MetricNames, text: str) -> tuple[float, float, float, int | None, int]:
    """What the adapter reads from one scrape (running, waiting, usage, block size, blocks)."""
    samples = parse_metrics(text)
    block_size = names.block_size(samples)
    return (samples.total(names.running) or 0.0, samples.total(names.waiting) or 0.0,
            samples.total(names.usage) or 0.0, block_size,
            names.capacity_blocks(samples, block_size or 16))


def sane(result: tuple[float, float, float, int | None, int]) -> bool:
    running, waiting, usage, block_size, blocks = result
    return (running >= 0 and waiting >= 0 and usage >= 0 and blocks >= 0
            and (block_size is None or 0 < block_size <= 1 << 20))


PROBES: dict[str, tuple[MetricNames, Callable[[], str]]] = {
    "good": (VLLM, lambda: GOOD_VLLM),
    "empty": (VLLM, lambda: ""),
    "garbage": (VLLM, lambda: "}{ not metrics\n"),
    "a NaN gauge": (VLLM, lambda: GOOD_VLLM.replace("} 2\n", "} NaN\n", 1)),
    "an infinite gauge": (VLLM, lambda: GOOD_VLLM.replace("} 1\n", "} +Inf\n", 1)),
    "a negative running count": (VLLM, lambda: GOOD_VLLM.replace("} 2\n", "} -3\n", 1)),
    "a huge float": (VLLM, lambda: GOOD_VLLM.replace("} 2\n", "} 1e400\n", 1)),
    "a body over the limit": (VLLM, lambda: GOOD_VLLM + "#" * MAX_METRICS_BYTES),
    "a block size that is not a number": (VLLM, lambda: GOOD_VLLM.replace('"16"', '"abc"')),
    "a zero block size": (VLLM, lambda: GOOD_VLLM.replace('"16"', '"0"')),
    "a negative block size": (VLLM, lambda: GOOD_VLLM.replace('"16"', '"-16"')),
    "a block size of 10**30": (VLLM, lambda: GOOD_VLLM.replace('"16"', '"' + "1" + "0" * 30
                                                               + '"')),
    "a negative block count": (VLLM, lambda: GOOD_VLLM.replace('"1000"', '"-1000"')),
    "a bad label escape": (VLLM, lambda: GOOD_VLLM.replace('"m"}', '"m\\q"}', 1)),
    "a label without quotes": (VLLM, lambda: GOOD_VLLM.replace('"m"', "m", 1)),
    "a line without a value": (VLLM, lambda: GOOD_VLLM + "vllm:num_requests_running\n"),
    "a NUL byte": (VLLM, lambda: GOOD_VLLM.replace("2\n", "2\x00\n", 1)),
    "one series twice": (VLLM, lambda: GOOD_VLLM + 'vllm:num_requests_running{model_name="m"} 5\n'),
    "10,000 label sets": (VLLM, lambda: GOOD_VLLM + "".join(
        f'vllm:num_requests_running{{model_name="m{i}"}} 1\n' for i in range(10_000))),
    "sglang: a zero page size": (SGLANG, lambda: (
        "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:token_usage 0.1\n"
        "sglang:page_size 0\nsglang:max_total_num_tokens 1000\n")),
    "sglang: a negative token capacity": (SGLANG, lambda: (
        "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:token_usage 0.1\n"
        "sglang:page_size 16\nsglang:max_total_num_tokens -1000\n")),
    "sglang: a fractional page size": (SGLANG, lambda: (
        "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:token_usage 0.1\n"
        "sglang:page_size 0.5\nsglang:max_total_num_tokens 1000\n")),
    "trtllm: a NaN block count": (TRTLLM, lambda: (
        "trtllm_num_requests_running 1\ntrtllm_num_requests_waiting 0\n"
        "trtllm_kv_cache_utilization 0.1\ntrtllm_kv_cache_tokens_per_block 32\n"
        "trtllm_kv_cache_max_blocks NaN\n")),
}


@pytest.mark.parametrize(("names", "text"), PROBES.values(), ids=PROBES.keys())
def test_scrape_probe(names: MetricNames, text: Callable[[], str]) -> None:
    try:
        result = read(names, text())
    except MetricsError as exc:
        assert str(exc)
        return
    assert sane(result), result
