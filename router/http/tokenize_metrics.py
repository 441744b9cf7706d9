"""The router's tokenization figures for ``/metrics``: the segment cache and the estimate of
the tokens it did not encode (:mod:`openai_request.segment_cache`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from openai_request.segment_cache import SegmentedTokenizer
from openai_request.tokenizer import Tokenizer

__all__ = ["tokenize_families"]


def tokenize_families(tokenizer: Tokenizer) -> Iterator[Metric]:
    """The families of a segment-cached tokenizer; none for any other."""
    if not isinstance(tokenizer, SegmentedTokenizer):
        return
    stats = tokenizer.stats()
    counters: tuple[tuple[str, int, str], ...] = (
            ("hits", stats.hits, "Prompt segments whose ids came from the cache"),
            ("misses", stats.misses, "Prompt segments the router had to tokenize"),
            ("estimated_tokens", stats.estimated_tokens,
             "Prompt tokens estimated from their bytes instead of tokenized (past the match)"))
    for name, count, text in counters:
        counter = CounterMetricFamily(f"kvroute_tokenize_{name}", text)
        counter.add_metric([], count)
        yield counter
    gauges: tuple[tuple[str, float, str], ...] = (
            ("cache_bytes", stats.cached_bytes, "Memory the segment cache is counted as holding"),
            ("cache_segments", stats.cached_segments, "Segments in the segment cache"),
            ("bytes_per_token", tokenizer.bytes_per_token,
             "UTF-8 bytes per token of the text tokenized so far (the estimate's ratio)"),
            ("estimate_error", stats.estimate_error_tokens / max(1, stats.encoded_tokens),
             "Mean absolute error of the bytes-per-token estimate on tokenized segments, "
             "as a share of their tokens"))
    for name, value, text in gauges:
        gauge = GaugeMetricFamily(f"kvroute_tokenize_{name}", text)
        gauge.add_metric([], value)
        yield gauge
