"""What peer block reads cost the holder: ``python -m bench.kv_read_share [--engine sim|torch]``.

One ``kvroute worker`` process on 127.0.0.1 (sim engine, or torch ``tiny`` on the CPU) holds a
prefix of ``--prefix-blocks`` blocks. Each round runs the holder's own requests
(``--requests`` prompts of their own, one at a time, ``--max-tokens`` each) twice,
alternating: once alone, once while ``--readers`` peers read the prefix's blocks by key in a
loop (``POST /kv_transfer/read``, answers read to the end). Printed, medians over
``--rounds``:

- ``own_s_alone`` / ``own_s_with_reads``: seconds the holder's own requests took;
- ``slowdown``: the second over the first, minus one (the holder's requests' extra time);
- ``reads_per_s``, ``blocks_per_s`` and ``read_mb_per_s``: what the peers were served
  meanwhile (the sim engine answers a count and sends no KV bytes: its MB are 0; the
  receiver models the transfer's time);
- ``cpu_ms_per_read``: the holder process's CPU time per read, over ``--cpu-reads`` reads
  of the prefix one after another while it serves nothing else (the steadier figure: a
  process's CPU time is counted in 10 ms ticks, and the rounds are short).

Prompts are token ids, so the bench keys them as the worker does
(:class:`workers.cache.block_keys.RequestBlocks`) without its tokenizer. Wall-clock figures
on a shared machine are noisy; the two variants alternate in one run so that load from
elsewhere falls on both.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from bench.figures import print_figures
from bench.http_load import process_cpu_seconds, spawn, stop
from kvroute.up import free_port
from workers.cache.block_keys import Prompt, RequestBlocks

__all__ = ["main", "measure"]

def _args(engine: str, port: int, block_size: int) -> list[str]:
    args = ["worker", "--port", str(port), "--no-events", "--block-size", str(block_size),
            "--kv-read-concurrency", "8"]
    if engine == "torch":
        return [*args, "--engine", "torch", "--torch-model", "tiny", "--device", "cpu",
                "--kv-memory-gb", "0.2", "--no-cuda-graphs"]
    return [*args, "--num-blocks", "8192"]


def _keys(token_ids: list[int], block_size: int) -> list[str]:
    blocks = RequestBlocks(Prompt(token_ids), block_size)
    return [blocks.block(i).key.hex() for i in range(blocks.num_full_blocks)]


async def _own(client: httpx.AsyncClient, prompts: list[list[int]], max_tokens: int) -> float:
    started = time.perf_counter()
    for ids in prompts:
        answer = await client.post("/v1/completions",
                                   json={"prompt": ids, "max_tokens": max_tokens})
        answer.raise_for_status()
    return time.perf_counter() - started


async def _reader(client: httpx.AsyncClient, keys: list[str], stop: asyncio.Event,
                  served: list[int]) -> None:
    while True:  # one read at least, however short the holder's requests
        async with client.stream("POST", "/kv_transfer/read",
                                 json={"block_keys": keys}) as answer:
            size = 0
            async for chunk in answer.aiter_bytes():
                size += len(chunk)
            if answer.status_code == 200:
                served[0] += 1
                served[1] += size
        if stop.is_set():
            return


async def _cpu_per_read(client: httpx.AsyncClient, pid: int, keys: list[str], reads: int
                        ) -> float:
    cpu0 = process_cpu_seconds(pid)
    for _ in range(reads):
        answer = await client.post("/kv_transfer/read", json={"block_keys": keys})
        answer.raise_for_status()
    return (process_cpu_seconds(pid) - cpu0) / reads * 1e3


async def _rounds(url: str, pid: int, engine: str, rounds: int, requests: int,
                  max_tokens: int, prefix_blocks: int, readers: int, block_size: int,
                  cpu_reads: int) -> dict[str, float]:
    prefix = [4 + (i * 7) % 200 for i in range(prefix_blocks * block_size + 1)]
    keys = _keys(prefix, block_size)[:prefix_blocks]
    alone_s: list[float] = []
    with_s: list[float] = []
    rates: list[float] = []
    mbs: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        (await client.post("/v1/completions", json={"prompt": prefix, "max_tokens": 1})
         ).raise_for_status()
        held = await client.post("/kv_transfer/read", json={"block_keys": keys})
        if engine == "sim" and held.json() != {"blocks": len(keys)}:
            raise RuntimeError(f"the holder holds {held.text} of the {len(keys)} blocks")
        for r in range(rounds):
            mine = [[5 + (r * 31 + i * 13 + j) % 200 for j in range(8 * block_size)]
                    for i in range(2 * requests)]
            alone_s.append(await _own(client, mine[:requests], max_tokens))
            halt, served = asyncio.Event(), [0, 0]
            tasks = [asyncio.create_task(_reader(client, keys, halt, served))
                     for _ in range(readers)]
            seconds = await _own(client, mine[requests:], max_tokens)
            halt.set()
            await asyncio.gather(*tasks)
            with_s.append(seconds)
            reads, size = served
            if engine == "sim":  # a count, no KV bytes
                size = 0
            rates.append(reads / seconds)
            mbs.append(size / seconds / 1e6)
        cpu = await _cpu_per_read(client, pid, keys, cpu_reads)
    alone, with_reads = statistics.median(alone_s), statistics.median(with_s)
    return {"own_s_alone": alone, "own_s_with_reads": with_reads,
            "slowdown": with_reads / alone - 1, "reads_per_s": statistics.median(rates),
            "blocks_per_s": statistics.median(rates) * prefix_blocks,
            "read_mb_per_s": statistics.median(mbs), "cpu_ms_per_read": cpu}


def measure(engine: str = "sim", rounds: int = 3, requests: int = 6, max_tokens: int = 8,
            prefix_blocks: int = 64, readers: int = 2, block_size: int = 32,
            cpu_reads: int = 200) -> dict[str, float]:
    """The module docstring's figures for one engine."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn(_args(engine, port, block_size), url, timeout=180)
    try:
        return asyncio.run(_rounds(url, proc.pid, engine, rounds, requests, max_tokens,
                                   prefix_blocks, readers, block_size, cpu_reads))
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["sim", "torch", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prefix-blocks", type=int, default=64)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--cpu-reads", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    engines = ["sim", "torch"] if args.engine == "both" else [args.engine]
    figures: dict[str, float] = {}
    for engine in engines:
        got = measure(engine, args.rounds, args.requests, args.max_tokens,
                      args.prefix_blocks, args.readers, cpu_reads=args.cpu_reads)
        figures |= {f"{engine}_{name}": value for name, value in got.items()}
    print_figures(figures, args.json)


if __name__ == "__main__":
    main()
