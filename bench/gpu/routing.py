"""The first routing attempt, kept for comparison: engines in this process on one device,
placed round-robin or by kvroute's index and scheduler (``bench.gpu_routing`` is the routing
benchmark)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, cast

from bench.gpu.harness import BS, random_tokens
from indexer.decode import decode_batch
from indexer.index import PrefixIndex, block_hashes, scope_seed
from indexer.wire import KVEventBatch, encode_batch
from openai_request.tokenizer import ByteTokenizer
from router.routing.rates import DEFAULT_RATES
from router.routing.residency import PredictedResidency
from router.routing.scheduler import Candidate, choose
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink
from workers.cache.publisher import EventPublisher
from workers.engine.batcher import Batcher, EngineRequest
from workers.engine.loop import Engine, RequestHandle
from workers.torch.engine import TorchExecutor
from workers.torch.kv import PagedKV

TOKENS_PER_HASH = 64  # the trace's 512-token blocks, scaled by 1/8


class IndexFeed:
    """Stands in for a worker's publisher: each batch goes through the wire codec into the
    router's index, as a ZMQ subscriber would apply it (minus the socket)."""

    def __init__(self, index: Any, worker: int) -> None:
        self.index, self.worker = index, worker
        self.next_seq = 0

    async def publish(self, batch: KVEventBatch) -> int:
        self.index.apply_batch(self.worker, decode_batch(encode_batch(batch)).events)
        self.next_seq += 1
        return self.next_seq - 1


def load_trace(path: Path, first: int, count: int) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[first : first + count]


_HASH_TOKENS: dict[int, list[int]] = {}


def trace_prompt(row: dict[str, Any]) -> list[int]:
    """The row's prompt: each hash id's 64 deterministic tokens, cut to input_length / 8."""
    tokens: list[int] = []
    for h in row["hash_ids"]:
        block = _HASH_TOKENS.get(h)
        if block is None:
            block = _HASH_TOKENS[h] = random_tokens(random.Random(h), TOKENS_PER_HASH)
        tokens.extend(block)
    n = max(1, -(-row["input_length"] // (512 // TOKENS_PER_HASH)))
    return tokens[:n]


async def replay(
    args: argparse.Namespace, policy: str, rows: list[dict[str, Any]], span_s: float, model: Any
) -> dict[str, Any]:
    """Replay ``rows`` over ``--workers`` engines placed by ``policy``; TTFT and throughput."""
    index = PrefixIndex(BS)
    engines: list[Engine] = []
    for w in range(args.workers):
        cache = CacheManager(args.worker_blocks, BS)
        kv = PagedKV(
            num_layers=model.config.num_layers,
            block_size=BS,
            kv_heads=model.config.num_kv_heads,
            head_dim=model.config.head_dim,
            num_blocks=args.worker_blocks,
            host_blocks=0,
            dtype=model.dtype,
            device=model.device,
        )
        ex = TorchExecutor(model, kv, vocab_limit=ByteTokenizer.vocab_size)
        batcher = Batcher(cache, max_num_batched_tokens=8192)
        engines.append(
            Engine(
                cache, batcher, ex, EventSink(), cast(EventPublisher, IndexFeed(index, w)), rank=w
            )
        )
    for e in engines:
        await e.start()
    predicted = PredictedResidency(ttl=2.0)
    rates, rng = DEFAULT_RATES["kvroute"].per_block(BS), random.Random(0)
    seed = scope_seed(None, None)
    t0 = rows[0]["timestamp"]
    last = rows[-1]["timestamp"] - t0 or 1
    ttft: list[float] = []
    tokens_out = 0
    start = time.perf_counter()

    async def consume(handle: RequestHandle, arrived: float) -> None:
        nonlocal tokens_out
        async for out in handle:
            if out.first:
                ttft.append(time.perf_counter() - arrived)
            tokens_out += 1

    tasks = []
    for i, row in enumerate(rows):
        due = start + (row["timestamp"] - t0) / last * span_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        prompt = trace_prompt(row)
        if policy == "round_robin":
            worker = i % args.workers
        else:
            now = time.perf_counter()
            hashes = block_hashes(prompt, BS, seed=seed)
            matches = index.match(hashes)
            candidates = []
            for w, e in enumerate(engines):
                matched, device = matches.get(w, (0, 0))
                extended = predicted.extend(w, hashes, matched, now)
                load = e.load()
                candidates.append(
                    Candidate(
                        w,
                        matched_blocks=extended,
                        device_matched_blocks=device + extended - matched,
                        wait_s=rates.prefill_s * load["pending_prefill_tokens"] / BS
                        + rates.decode_s * load["decode_blocks"],
                        rates=rates,
                        pending_prefill_blocks=load["pending_prefill_tokens"] / BS,
                        decode_blocks=load["decode_blocks"],
                        active_requests=int(load["running"] + load["waiting"]),
                    )
                )
            worker = choose(len(hashes), candidates, rng).worker
            predicted.predict(worker, hashes, now)
        max_tokens = max(1, row["output_length"] // 8)
        handle = engines[worker].submit(
            EngineRequest(f"r{i}", Prompt(prompt), max_tokens, ignore_eos=True)
        )
        tasks.append(asyncio.create_task(consume(handle, time.perf_counter())))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    stats = [e.cache.stats() for e in engines]
    for e in engines:
        await e.stop()
    query = sum(s.query_tokens for s in stats)
    prompt_tokens = sum(len(trace_prompt(r)) for r in rows)
    ttft.sort()
    return {
        "policy": policy,
        "requests": len(rows),
        "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3,
        "ttft_p99_ms": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] * 1e3,
        "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
        "makespan_s": elapsed,
        "requests_per_s": len(rows) / elapsed,
        "tokens_per_s": (prompt_tokens + tokens_out) / elapsed,
        "hit_rate": sum(s.hit_tokens for s in stats) / query if query else 0.0,
        "preemptions": sum(e.batcher.preemptions for e in engines),
    }
