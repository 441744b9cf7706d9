"""A flood of low-priority long chats against a trickle of high-priority short ones, through
a ``kvroute router`` with its DEFAULT settings in front of real ``kvroute worker`` processes
(``python -m bench.flow_flood``).

The scenario: ``--workers`` workers (the sim engine at ``--speedup``, ``--max-num-seqs``
sequences each), ``--low`` long chats of body ``priority`` 10 sent ``--low-gap`` seconds apart
(``--low-prompt`` characters, one token each under the byte tokenizer, ``--low-tokens``
answer tokens), and ``--high`` short chats of ``priority`` 0 (``--high-prompt`` characters,
``--high-tokens`` answer tokens) spread evenly over the flood. Every client gives up after
``--client-timeout`` seconds. The high-priority chats are first sent alone, on the same
cluster before the flood (prompts differ between the phases, so nothing is cached across
them), to give their TTFT without load.

It prints, per run: the high-priority TTFT p50/p99 alone and under the flood (and their
ratios), the served low-priority chats' TTFT p50/p99, how long a refused request waited for
its refusal (p50 and the longest), and how each request of the flood ended: served (200,
whole stream), refused by status (429 with or without ``Retry-After``, 503, other), timed out
at the client, lost (the connection broke or the stream ended early). ``--code PATH`` runs
the router and workers from another checkout (``PYTHONPATH=PATH``; repeat it, ``.`` for this
tree), so two commits' behaviour is measured in one sitting, alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.http_load import stop, wait_ready
from kvroute.up import free_port

__all__ = ["Outcome", "main", "run"]

_WORDS = ("alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "papa", "sierra",
          "tango", "victor", "zulu", "amber", "basil", "cedar", "dune", "ember", "fjord")


@dataclass(slots=True)
class Outcome:
    """How one request ended, as its client saw it."""

    priority: int
    #: "served", "refused", "timeout" or "lost".
    end: str
    status: int = 0
    retry_after: str | None = None
    ttft_s: float = -1.0
    #: Seconds from sending to the answer's status line.
    answered_s: float = -1.0


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:chars]


async def _chat(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                priority: int, timeout_s: float) -> Outcome:
    body = {"model": "kvroute-sim", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True, "priority": priority}
    start = time.monotonic()
    out = Outcome(priority, "lost")
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                out.status = resp.status
                out.answered_s = time.monotonic() - start
                if resp.status != 200:
                    out.end = "refused"
                    out.retry_after = resp.headers.get("retry-after")
                    await resp.read()
                    return out
                done = False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    if out.ttft_s < 0:
                        chunk = json.loads(data)
                        choices = chunk.get("choices") or []
                        if choices and (choices[0].get("delta") or {}).get("content"):
                            out.ttft_s = time.monotonic() - start
                out.end = "served" if done else "lost"
    except TimeoutError:
        out.end = "timeout"
    except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError):
        out.end = "lost"
    return out


async def _phase(url: str, args: argparse.Namespace, seed: int, flood: bool
                 ) -> list[Outcome]:
    """The high-priority trickle, with the flood (``flood``) or alone."""
    rng = random.Random(seed)
    window = args.low * args.low_gap
    gap_high = window / max(args.high, 1)
    jobs: list[tuple[float, str, int, int]] = []
    if flood:
        jobs += [(i * args.low_gap, _text(rng, args.low_prompt), args.low_tokens, 10)
                 for i in range(args.low)]
    jobs += [((i + 0.5) * gap_high, _text(rng, args.high_prompt), args.high_tokens, 0)
             for i in range(args.high)]
    jobs.sort(key=lambda j: j[0])
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.monotonic()
        tasks = []
        for at, prompt, tokens, priority in jobs:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                _chat(session, url, prompt, tokens, priority, args.client_timeout)))
        return list(await asyncio.gather(*tasks))


def _spawn(argv: list[str], code: str | None, url: str) -> subprocess.Popen[bytes]:
    """``kvroute <argv>`` from the checkout ``code`` (None: this one), ready at ``url``."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = code
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", *argv, "--log-level",
                             "warning"], env=env, cwd=code or None,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    return wait_ready(proc, url, f"kvroute {' '.join(argv)}", 60)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(alone: Sequence[Outcome], flood: Sequence[Outcome]) -> dict[str, Any]:
    """One run's figures (module docstring)."""
    def ttfts(outs: Sequence[Outcome]) -> list[float]:
        return [o.ttft_s for o in outs if o.priority == 0 and o.end == "served"
                and o.ttft_s >= 0]

    a, f = ttfts(alone), ttfts(flood)
    ends: Counter[str] = Counter()
    for o in flood:
        if o.end == "refused":
            tag = f"refused_{o.status}"
            if o.status == 429 and o.retry_after is None:
                tag += "_no_retry_after"
            ends[tag] += 1
        else:
            ends[o.end] += 1
    high = [o for o in flood if o.priority == 0]
    low = [o.ttft_s for o in flood if o.priority != 0 and o.end == "served" and o.ttft_s >= 0]
    refused = [o.answered_s for o in flood if o.end == "refused"]
    return {"alone_p50_ms": _pct(a, 0.5) * 1e3, "alone_p99_ms": _pct(a, 0.99) * 1e3,
            "flood_p50_ms": _pct(f, 0.5) * 1e3, "flood_p99_ms": _pct(f, 0.99) * 1e3,
            "ratio_p50": _pct(f, 0.5) / _pct(a, 0.5) if a and f else float("nan"),
            "ratio_p99": _pct(f, 0.99) / _pct(a, 0.99) if a and f else float("nan"),
            "high_served": sum(o.end == "served" for o in high), "high": len(high),
            "low_ttft_p50_s": _pct(low, 0.5), "low_ttft_p99_s": _pct(low, 0.99),
            "refused_answer_p50_s": _pct(refused, 0.5),
            "refused_answer_max_s": max(refused, default=float("nan")),
            "requests": len(flood), **dict(sorted(ends.items()))}


def run(args: argparse.Namespace, code: str | None) -> dict[str, Any]:
    """Start a cluster from ``code`` (None: this tree), send both phases, stop it."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        router_port = free_port()
        router = ["router", "--port", str(router_port)]
        for _ in range(args.workers):
            port = free_port()
            procs.append(_spawn(["worker", "--port", str(port), "--events-port",
                                 str(free_port()), "--replay-port", str(free_port()),
                                 "--speedup", str(args.speedup),
                                 "--max-num-seqs", str(args.max_num_seqs)],
                                code, f"http://127.0.0.1:{port}/health"))
            router += ["--worker", f"http://127.0.0.1:{port}"]
        url = f"http://127.0.0.1:{router_port}"
        procs.append(_spawn(router + list(args.router_arg), code, f"{url}/ready"))
        time.sleep(1.5)  # a /load report from each worker
        alone = asyncio.run(_phase(url, args, args.seed, flood=False))
        flood = asyncio.run(_phase(url, args, args.seed + 1, flood=True))
    finally:
        for proc in procs:
            stop(proc)
    return summarize(alone, flood)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags, run each ``--code`` tree in turn, print one JSON line per run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--speedup", type=float, default=0.5)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--low", type=int, default=600)
    p.add_argument("--low-gap", type=float, default=0.010)
    p.add_argument("--low-prompt", type=int, default=2000)
    p.add_argument("--low-tokens", type=int, default=400)
    p.add_argument("--high", type=int, default=20)
    p.add_argument("--high-prompt", type=int, default=60)
    p.add_argument("--high-tokens", type=int, default=16)
    p.add_argument("--client-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--code", action="append", default=None,
                   help="a checkout to run the router and workers from (repeat to compare; "
                        "'.' is this tree)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="an extra router flag (repeat); none: the defaults")
    args = p.parse_args(argv)
    for code in args.code or ["."]:
        row = run(args, None if code == "." else code)
        print(json.dumps({"code": code, "low": args.low, "high": args.high,
                          "low_gap_s": args.low_gap, **row}), flush=True)


if __name__ == "__main__":
    main()
