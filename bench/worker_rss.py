"""A simulated worker's resident memory under the soak's two heaviest loads, round after round
(``python -m bench.worker_rss``).

One ``kvroute worker`` (the sim engine at ``--speedup``, images allowed from 127.0.0.1) gets,
each round, ``--images`` chat requests naming 16 distinct 15 MB images on a local image server
(:class:`bench.soak_hostile.HostilePeers`; each is refused at the worker's 64 MiB of images a
request, after its 16 fetches have begun), one after the other, then ``--chats`` long chats
like the soak's flood (a document of about 8,100 characters, one token each under the byte
tokenizer, 64 tokens out), ``--concurrency`` at a time. It prints one JSON line per round:
the requests sent so far and the worker's RSS. ``--code PATH`` runs the worker from another
checkout (``PYTHONPATH=PATH``; repeat it, ``.`` for this tree), so two commits are measured in
one sitting.

What it showed (``docs/operations.md``, "Soak"): before the fixes, each refused image request
left 75-85 MiB in reference cycles that the worker's rare cycle collector did not reach, and
each long chat 65 KiB in the sim's seed cache; after, the RSS stays flat from the first round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence

import aiohttp

from bench.http_load import stop, wait_ready
from bench.soak import rss_kib
from bench.soak_hostile import IMAGES, Hostile, HostilePeers
from kvroute.up import free_port

__all__ = ["main"]


def _spawn(code: str | None, port: int, speedup: float) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = code
    argv = ["worker", "--port", str(port), "--events-port", str(free_port()), "--replay-port",
            str(free_port()), "--speedup", str(speedup), "--allow-image-hosts", "127.0.0.1",
            "--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", *argv], env=env,
                            cwd=code or None, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    return wait_ready(proc, f"http://127.0.0.1:{port}/health", "kvroute worker", 60)


async def _images(session: aiohttp.ClientSession, url: str, peers: HostilePeers, first: int,
                  n: int, seen: Counter[str]) -> None:
    for k in range(first, first + n):
        parts: list[dict[str, object]] = [{"type": "text", "text": "describe these"}]
        parts += [{"type": "image_url", "image_url": {"url": peers.image_url(k * IMAGES + i)}}
                  for i in range(IMAGES)]
        body = {"model": "kvroute-sim", "max_tokens": 4,
                "messages": [{"role": "user", "content": parts}]}
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            await r.read()
            seen[f"image {r.status}"] += 1


async def _chats(session: aiohttp.ClientSession, url: str, n: int, concurrency: int,
                 rng: random.Random, seen: Counter[str]) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        doc = f"Batch document {rng.randrange(10**9)}: " + "lorem ipsum dolor sit amet " * 300
        body = {"model": "kvroute-sim", "max_tokens": 64, "stream": True,
                "messages": [{"role": "user", "content": doc + "\nSummarise it."}]}
        async with gate, session.post(f"{url}/v1/chat/completions", json=body) as r:
            await r.read()
            seen[f"chat {r.status}"] += 1

    await asyncio.gather(*(one() for _ in range(n)))


async def _run(args: argparse.Namespace, code: str) -> None:
    peers = HostilePeers(Hostile())
    await peers.start()
    port = free_port()
    proc = await asyncio.to_thread(_spawn, None if code == "." else code, port,
                                    args.speedup)
    url = f"http://127.0.0.1:{port}"
    seen: Counter[str] = Counter()
    rng = random.Random(args.seed)
    try:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            print(json.dumps({"code": code, "round": 0, "requests": 0,
                              "rss_mib": round(rss_kib(proc.pid) / 1024, 1)}), flush=True)
            for i in range(1, args.rounds + 1):
                await _images(session, url, peers, (i - 1) * args.images, args.images, seen)
                await _chats(session, url, args.chats, args.concurrency, rng, seen)
                print(json.dumps({"code": code, "round": i, "requests": sum(seen.values()),
                                  "rss_mib": round(rss_kib(proc.pid) / 1024, 1),
                                  **dict(sorted(seen.items()))}), flush=True)
    finally:
        stop(proc)
        await peers.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags, run each ``--code`` tree in turn, print one JSON line per round."""
    p = argparse.ArgumentParser(prog="python -m bench.worker_rss",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--speedup", type=float, default=100.0, help="the sim engine's speedup")
    p.add_argument("--images", type=int, default=5, help="image requests a round")
    p.add_argument("--chats", type=int, default=100, help="long chats a round")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--code", action="append", default=None,
                   help="a checkout to run the worker from (repeat to compare; '.' is this "
                        "tree)")
    args = p.parse_args(argv)
    for code in args.code or ["."]:
        asyncio.run(_run(args, code))


if __name__ == "__main__":
    main()
