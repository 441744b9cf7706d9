"""Micro-benchmark of the prefix index: ``python -m bench.index [--json] [--quick]``.

Builds an index of about 1,000,000 resident (block, worker) pairs over 8 workers with
realistic prefix sharing, then measures for each implementation, in one run:

- ``apply_blocks_per_s``: stores and removals applied, in batches as engines send them
  (token re-hash included), at steady state: new conversations stored while old ones are
  evicted leaf first. ``build_blocks_per_s`` is the store-only rate while building.
- ``match_p50_us`` / ``match_p99_us``: one 128-block query; half follow a resident
  conversation deep into its context, half share only a system prompt.
- ``hash_8k_tokens_us``: ``block_hashes`` of an 8,192-token prompt (a list of ints), block 32.
- ``bytes_per_block``: ``memory_bytes()`` per resident (block, worker) pair.

and ``floor_128_reads_us``: 128 independent random prefetched reads from a plain table as
large as the native index, the memory system's floor for one query. The reference is
measured on a smaller index (``pairs`` says how large): building 1M blocks in pure Python
takes minutes. See ``docs/prefix_index.md`` for what the numbers taught us.

The workload: 32 system prompts of 8-64 blocks, each held by most workers; conversations of
32-256 blocks after a system prompt, each on one worker; engines commit a conversation's
blocks 16 at a time (one BlockStored each), a few events per batch, and evict a
conversation's blocks leaf first, 16 per BlockRemoved.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from bench.figures import percentile
from indexer.events import Removed, Stored
from indexer.hashing import GLOBAL_SEED

BLOCK = 32
WORKERS = 8
QUERY_BLOCKS = 128
CHUNK = 16  # blocks per BlockStored / BlockRemoved
EVENTS_PER_BATCH = 4


class Workload:
    """Generates the event streams and queries of the benchmark, deterministically."""

    def __init__(self, seed: int = 1) -> None:
        self.rng = rng = random.Random(seed)
        self.pool = [[rng.randrange(150_000) for _ in range(BLOCK)] for _ in range(2048)]
        self.systems = [[rng.randrange(len(self.pool)) for _ in range(rng.randint(8, 64))]
                        for _ in range(32)]
        self.next_conv = 0
        self.next_engine = 1
        self.system_engine: dict[tuple[int, int], list[int]] = {}  # (worker, system) -> hashes
        # (conversation, worker, system prompt, block contents, engine hashes), oldest first
        self.convs: deque[tuple[int, int, int, list[int], list[int]]] = deque()

    def _tokens(self, contents: list[int], first: int | None = None) -> list[int]:
        out: list[int] = []
        for c in contents:
            out += self.pool[c]
        if first is not None:
            out[0] = first
        return out

    def _engine_hashes(self, n: int) -> list[int]:
        start = self.next_engine
        self.next_engine += n
        return [(h * 0x9E3779B97F4A7C15) & (2**64 - 1) for h in range(start, start + n)]

    def conversation(self) -> tuple[int, list[Stored]]:
        """A new conversation: its worker and the stores its engine publishes, in order."""
        rng = self.rng
        conv, worker = self.next_conv, self.next_conv % WORKERS
        self.next_conv += 1
        system = rng.randrange(len(self.systems))
        events: list[Stored] = []
        sys_hashes = self.system_engine.get((worker, system))
        if sys_hashes is None:
            sys_hashes = self._engine_hashes(len(self.systems[system]))
            self.system_engine[(worker, system)] = sys_hashes
            events.append(Stored(sys_hashes, None, self._tokens(self.systems[system]), BLOCK))
        contents = [rng.randrange(len(self.pool)) for _ in range(rng.randint(32, 256))]
        hashes = self._engine_hashes(len(contents))
        parent = sys_hashes[-1]
        for i in range(0, len(contents), CHUNK):
            first = 200_000 + conv if i == 0 else None  # the conversation's own first token
            events.append(Stored(hashes[i:i + CHUNK], parent,
                                 self._tokens(contents[i:i + CHUNK], first), BLOCK))
            parent = hashes[i + CHUNK - 1] if i + CHUNK <= len(hashes) else hashes[-1]
        self.convs.append((conv, worker, system, contents, hashes))
        return worker, events

    def evict_oldest(self) -> tuple[int, list[Removed], int]:
        _, worker, _, _, hashes = self.convs.popleft()
        rev = hashes[::-1]
        return worker, [Removed(rev[i:i + CHUNK]) for i in range(0, len(rev), CHUNK)], len(rev)

    def queries(self, n: int, block_hashes: Callable[..., list[int]]) -> list[list[int]]:
        """``n`` query hash lists: half deep into a resident conversation, half shallow."""
        rng = self.rng
        out = []
        convs = list(self.convs)
        for k in range(n):
            if k % 2 == 0:
                conv, _, system, contents, _ = rng.choice(convs)
                own = self._tokens(contents, 200_000 + conv)
            else:
                system = rng.randrange(len(self.systems))
                own = self._tokens([rng.randrange(len(self.pool)) for _ in range(QUERY_BLOCKS)])
            tokens = self._tokens(self.systems[system]) + own
            out.append(block_hashes(tokens[:QUERY_BLOCKS * BLOCK], BLOCK, seed=GLOBAL_SEED))
        return out


def _batches(worker: int, events: list[Any]) -> Iterator[tuple[int, list[Any]]]:
    for i in range(0, len(events), EVENTS_PER_BATCH):
        yield worker, events[i:i + EVENTS_PER_BATCH]


def _build(index: Any, load: Workload, pairs: int) -> tuple[float, int]:
    """Store conversations until ``pairs`` blocks are resident; return (seconds, blocks)."""
    elapsed, blocks = 0.0, 0
    while True:
        resident = sum(index.worker_blocks(w)[0] for w in range(WORKERS))
        if resident >= pairs:
            return elapsed, blocks
        chunk = []
        for _ in range(64):
            worker, events = load.conversation()
            chunk += list(_batches(worker, events))
            blocks += sum(len(e.block_hashes) for e in events)
        t = time.perf_counter()
        for worker, batch in chunk:
            index.apply_batch(worker, batch)
        elapsed += time.perf_counter() - t


def _churn(index: Any, load: Workload, conversations: int) -> tuple[float, int]:
    """Replace the oldest conversations by new ones; return (seconds, blocks applied)."""
    elapsed, blocks = 0.0, 0
    for _ in range(0, conversations, 32):
        chunk = []
        for _ in range(32):
            worker, events = load.conversation()
            chunk += list(_batches(worker, events))
            blocks += sum(len(e.block_hashes) for e in events)
            old_worker, removals, n = load.evict_oldest()
            chunk += list(_batches(old_worker, removals))
            blocks += n
        t = time.perf_counter()
        for worker, batch in chunk:
            index.apply_batch(worker, batch)
        elapsed += time.perf_counter() - t
    return elapsed, blocks


def measure(impl: Any, pairs: int, queries: int, churn: int) -> dict[str, Any]:
    """Build, churn and query one implementation's index; return its figures."""
    index = impl.PrefixIndex(BLOCK)
    load = Workload()
    build_s, build_blocks = _build(index, load, pairs)
    churn_s, churn_blocks = _churn(index, load, churn)
    resident = sum(index.worker_blocks(w)[0] for w in range(WORKERS))
    qs = load.queries(queries, impl.block_hashes)
    match = index.match
    for q in qs[:200]:
        match(q)
    times = []
    clock = time.perf_counter_ns
    for _ in range(3):
        for q in qs:
            t = clock()
            match(q)
            times.append((clock() - t) / 1000)
    tokens = [random.Random(2).randrange(150_000) for _ in range(8192)]
    hash_times = []
    for _ in range(5 if impl.name == "reference" else 2000):
        t = clock()
        impl.block_hashes(tokens, 32, seed=GLOBAL_SEED)
        hash_times.append((clock() - t) / 1000)
    hits = [len(index.match(q)) for q in qs[:100]]
    return {
        "pairs": resident,
        "distinct_blocks": index.num_blocks(),
        "build_blocks_per_s": round(build_blocks / build_s),
        "apply_blocks_per_s": round(churn_blocks / churn_s),
        "match_p50_us": round(percentile(times, 50), 2),
        "match_p99_us": round(percentile(times, 99), 2),
        "mean_workers_matched": round(sum(hits) / len(hits), 2),
        "hash_8k_tokens_us": round(percentile(hash_times, 50), 2),
        "bytes_per_block": round(index.memory_bytes() / resident, 1),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a table (or one JSON object with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small index, a few seconds")
    args = parser.parse_args(argv)
    import native._core

    import indexer.hashing
    import indexer.radix

    native_impl = type("Native", (), {"name": "native", "PrefixIndex": native._core.PrefixIndex,
                                      "block_hashes": native._core.block_hashes})
    reference = type("Reference", (), {"name": "reference",
                                       "PrefixIndex": indexer.radix.PrefixIndex,
                                       "block_hashes": indexer.hashing.block_hashes})
    pairs = 100_000 if args.quick else 1_000_000
    result: dict[str, Any] = {
        "native": measure(native_impl, pairs, 1000 if args.quick else 10_000,
                          200 if args.quick else 2000),
        "reference": measure(reference, pairs // 20, 300, 20),
    }
    table_bytes = round(result["native"]["bytes_per_block"] * result["native"]["pairs"])
    result["floor_128_reads_us"] = round(native._core.memory_floor_us(table_bytes), 2)
    result["notes"] = (f"reference measured on {result['reference']['pairs']} pairs, native on "
                       f"{result['native']['pairs']}; both 8 workers, block size {BLOCK}")
    if args.json:
        print(json.dumps(result))
        return
    keys = list(result["native"])
    print(f"{'':24}{'native':>14}{'reference':>14}")
    for k in keys:
        print(f"{k:24}{result['native'][k]:>14}{result['reference'][k]:>14}")
    print(f"{'floor_128_reads_us':24}{result['floor_128_reads_us']:>14}")
    print(result["notes"])


if __name__ == "__main__":
    main()
