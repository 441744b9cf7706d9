"""Worker benchmark: ``python -m bench.worker [--json] [--quick]``.

- ``commits_per_s``: cache-manager block commits per second under eviction churn: a pool of
  4,096 blocks, requests of 1-64 new blocks after one of 32 shared system prompts, each
  allocated, committed and freed, so the LRU evicts continually (events taken each round, as
  an engine does).
- ``events_per_s``: the event sink turning those facts into wire batches (the cap and
  coalescing included), in blocks per second.
- ``worker_rps``: requests per second one worker serves with 16 connections in flight when
  the model costs nothing (``--speedup 1e9``, ``max_tokens`` 1): the server's own overhead;
  ``worker_p50_ms`` over one connection.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from bench.figures import percentile, print_figures
from bench.http_load import latency, spawn, stop, throughput
from kvroute.up import free_port
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink

BLOCK = 32


def cache_churn(rounds: int) -> dict[str, float]:
    """Commits per second with eviction churn, and sink throughput."""
    rng = random.Random(11)
    cache = CacheManager(num_blocks=4096, block_size=BLOCK)
    sink = EventSink(max_pending_stored=100_000)
    systems = [[rng.randrange(4, 260) for _ in range(BLOCK * rng.randrange(8, 33))]
               for _ in range(32)]
    # Prompts are built before the clock starts: only the cache and the sink are timed.
    prompts = [Prompt(rng.choice(systems) + [rng.randrange(4, 260)
                                             for _ in range(BLOCK * rng.randrange(1, 65))])
               for _ in range(rounds)]
    committed = 0
    sink_seconds = 0.0
    started = time.perf_counter()
    for r, prompt in enumerate(prompts):
        tokens = prompt.token_ids
        rid = f"r{r}"
        allocation = cache.allocate(rid, prompt)
        if allocation is None:
            continue
        cache.commit_computed(rid, len(tokens))
        committed += len(tokens) // BLOCK - allocation.num_cached_tokens // BLOCK
        cache.free(rid)
        facts = cache.take_events()
        t = time.perf_counter()
        sink.capture(facts)
        sink.next_batch(0.0, 0)
        sink_seconds += time.perf_counter() - t
    elapsed = time.perf_counter() - started
    stats = cache.stats()
    return {"commits_per_s": round(committed / (elapsed - sink_seconds)),
            "events_blocks_per_s": round(sink.stats.stored / sink_seconds)
            if sink_seconds else 0,
            "evictions": stats.device_evictions, "hit_tokens": stats.hit_tokens}


def server_overhead(requests: int, seconds: float) -> dict[str, float]:
    """One sim worker whose model costs nothing: latency and requests per second."""
    port = free_port()
    proc = spawn(["worker", "--port", str(port), "--events-port", str(free_port()),
                  "--replay-port", str(free_port()), "--speedup", "1e9"],
                 f"http://127.0.0.1:{port}")
    body = {"model": "kvroute-sim", "prompt": "a small prompt", "max_tokens": 1}
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        one = latency(url, body, requests)
        rps, failed = throughput(url, body, 16, seconds)
    finally:
        stop(proc)
    return {"worker_p50_ms": round(percentile(one, 50) * 1e3, 3),
            "worker_p99_ms": round(percentile(one, 99) * 1e3, 3),
            "worker_rps": round(rps), "worker_failed": failed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small, fast run")
    args = parser.parse_args(argv)
    result: dict[str, Any] = cache_churn(2_000 if args.quick else 20_000)
    result |= server_overhead(200 if args.quick else 1000, 2.0 if args.quick else 5.0)
    print_figures(result, args.json)


if __name__ == "__main__":
    main()
