"""Routing over real engines: torch workers, each its own process, behind the real router.

Run (on a GPU machine, from the repository root)::

    python -m bench.gpu_routing --workers 4 --kv-memory-gb 20 --first 0 --count 600 \\
        --loads 0.9 --cold-rate 150000 --json bench-out/gpu_routing.json

For each load and each router policy (``--policies``, default ``round_robin,kv``) it starts a
fresh cluster with :class:`kvroute.up.Cluster`: ``--workers`` x ``kvroute worker --engine
torch`` on the one device (separate processes: each engine has its own interpreter, so none
waits on another's lock) and ``kvroute router --policy P``. Every worker is warmed up with a
prompt of its own (CUDA context, kernel plans) and its cache emptied; then the Mooncake trace
window ``--first .. --first + --count`` is replayed against the router over HTTP with
streaming (:func:`bench.live.replay_live`), each hash id its full 512 tokens, outputs the
trace's times ``--output-scale``.

Arrivals keep the trace's spacing, compressed so prompt tokens arrive at ``load x
--cold-rate`` tokens/s; ``--cold-rate`` is the device's cold prefill rate for one 8k-token
prompt, as ``python -m bench.gpu --sections ttft`` measures it. A load near 1 puts
round-robin at saturation: it recomputes most prefixes, kvroute reuses them.

Reported per run, from the client side: TTFT p50/p90/p99, end-to-end p50/p99, prefix hit rate
(``cached_tokens`` the workers report over prompt tokens), prompt and output tokens/s,
failed requests, and each worker's share of the requests (``x-kvroute-worker`` is not seen by
the streaming client, so shares come from each worker's ``/metrics``).

With ``--repeats N`` every (load, policy) runs N times, each on a fresh cluster, the policies
interleaved so that drift in the machine touches each alike; ``summary`` in the JSON (and the
table's last lines) gives each pair's medians and its p50 range. One run decides little here:
the same setting's TTFT p50 spread .599-.846 s over four runs on the H200 (``docs/gpu.md``).

``--slo S`` replaces ``--loads`` with a capacity search (:mod:`bench.capacity`): per policy one
cluster, every worker's cache emptied before each probe, a bisection over loads in
``--capacity-range`` for the highest whose TTFT p99 stays under S; printed with the goodput
there and kv's sustained load over round-robin's.

``--mps auto`` (the default) runs the workers under CUDA MPS where ``nvidia-cuda-mps-control``
is found, started before the cluster and stopped after it (:mod:`bench.gpu.mps`); four workers'
decode steps ran 1.4x faster together under it (``docs/gpu.md``). ``--max-num-batched-tokens``
sets the workers' prefill chunk.

Requests longer than ``--max-model-len`` are left out of the window (and counted): the longest
trace prompts (up to 191k tokens) would otherwise be refused by the router.

``--generator long_context --requests N`` replays a generated workload instead of the trace
(:mod:`bench.workloads`: conversations over documents, prompts 4k-64k tokens, replies of
200-500 tokens), timed the same way.

Memory: each worker takes ``--gpu-memory-utilization`` of the device (default 0.9 shared out
among the workers) and sizes its KV cache from what its profiled worst iteration leaves
(``--kv-memory-gb`` sets the cache instead). Reported per worker, from its ``/metrics``: the
budget, the KV cache, PyTorch's peak reserved memory (``torch.cuda.max_memory_reserved``), the
passes that ran out of memory and the requests recomputed or failed after a failed pass; and,
where ``nvidia-smi`` answers, the most device memory each worker process held, sampled every
second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.capacity import capacity_table, goodput, search_capacity, sustained_ratio
from bench.gpu.mps import MODES, Mps
from bench.live import replay_live, summarize_live
from bench.workloads import (
    DEFAULT_TRACE,
    GeneratorConfig,
    WorkloadRequest,
    generate,
    load_trace,
    scale_rate,
)
from kvroute.up import Cluster

__all__ = ["Fleet", "main", "run_capacity", "run_policy", "summarize_repeats", "window"]


def window(path: Path, first: int, count: int, max_len: int,
           output_scale: float = 1.0) -> tuple[list[WorkloadRequest], int]:
    """The trace's requests ``first .. first + count`` no longer than ``max_len`` tokens,
    re-timed from zero, outputs scaled by ``output_scale`` (at least one token); and how many
    were left out for length."""
    rows = load_trace(path, limit=first + count)[first:]
    kept = [r for r in rows if r.input_length <= max_len]
    t0 = kept[0].arrival_s if kept else 0.0
    out = [
        WorkloadRequest(r.request_id, r.arrival_s - t0, r.segments, r.input_length,
                        max(1, round(r.output_length * output_scale)), r.images, r.session)
        for r in kept
    ]
    return out, len(rows) - len(kept)


def generated(args: argparse.Namespace) -> tuple[list[WorkloadRequest], int]:
    """``--requests`` of generator ``--generator`` no longer than ``--max-model-len`` (prompt
    and reply), outputs scaled by ``--output-scale``; and how many were left out for length.

    Raises:
        ValueError: an unknown generator or a bad count.
    """
    rows = generate(args.generator, GeneratorConfig(requests=args.requests, rate=1.0), args.seed)
    kept = [replace(r, output_length=max(1, round(r.output_length * args.output_scale)))
            for r in rows]
    kept = [r for r in kept if r.input_length + r.output_length <= args.max_model_len]
    return kept, len(rows) - len(kept)


def post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url`` and return the JSON answer."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def worker_urls(cluster: Cluster) -> list[str]:
    """The URLs of the cluster's workers."""
    return [c.url for c in cluster.children if c.name.startswith("worker-")]


def warm_up(cluster: Cluster, tokens: int) -> None:
    """One request per worker straight to it (a prompt no trace request shares), then empty
    its cache so the run starts cold."""
    for i, url in enumerate(worker_urls(cluster)):
        prompt = [4 + (i * 7919 + j * 104729) % 256 for j in range(tokens)]
        post_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 4}, 300)
        post_json(f"{url}/reset_prefix_cache", {}, 30)


def _metric_sum(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


#: Worker statistics reported per run (``kvroute_worker_<name>`` in ``/metrics``).
MEMORY_METRICS = ("memory_budget_bytes", "memory_kv_bytes", "memory_iteration_bytes",
                  "memory_graph_bytes", "memory_peak_reserved_bytes", "out_of_memory_passes",
                  "failed_iterations", "failure_preemptions", "failed_requests", "preemptions",
                  "cache_releases")


def _worker_memory(url: str) -> dict[str, float]:
    return {name: _metric_sum(url, f"kvroute_worker_{name} ") for name in MEMORY_METRICS}


def router_args(args: argparse.Namespace, policy: str) -> list[str]:
    """The router's flags for ``policy``: seed 0, and ``--kv-fetch`` and the shared secret
    where given."""
    out = ["--policy", policy, "--seed", "0"]
    if args.kv_fetch is not None:
        out += ["--kv-fetch", args.kv_fetch]
    if args.kv_transfer_secret_file is not None:
        out += ["--kv-transfer-secret-file", args.kv_transfer_secret_file]
    return out


_SAMPLE = re.compile(r'^(\w+)(?:\{(\w+)="([^"]*)"\})? (\S+)$')


def labelled(text: str, name: str) -> dict[str, float]:
    """The samples of counter ``name`` in the exposition ``text``, by their one label's value
    (``""`` for an unlabelled sample)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m[1] == name:
            out[m[3] or ""] = out.get(m[3] or "", 0.0) + float(m[4])
    return out


def _text(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return resp.read().decode()


def fetch_counts(router: str, workers: Sequence[str]) -> dict[str, float]:
    """Peer-fetch counters now: the router's fetch results by outcome (``fetched``, ...), the
    KV bytes fetched, and the workers' fetches by transfer (``http``, ``cuda_ipc``), summed."""
    text = _text(router)
    out = {f"router_{k}": v for k, v in labelled(text, "kvroute_fetch_results_total").items()}
    out["router_bytes"] = sum(labelled(text, "kvroute_fetch_bytes_total").values())
    for url in workers:
        for k, v in labelled(_text(url), "kvroute_worker_kv_fetch_transfers_total").items():
            out[f"worker_{k}"] = out.get(f"worker_{k}", 0.0) + v
    return out


class ProcessMemory:
    """The most device memory each process held, sampled from ``nvidia-smi`` every second
    in a thread (empty where ``nvidia-smi`` is missing or does not list processes)."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ProcessMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                text = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                     "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10, check=True).stdout
            except (OSError, subprocess.SubprocessError):
                return
            for line in text.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip().isdigit() and mib.strip().isdigit():
                    used = int(mib) << 20
                    self.peak[int(pid)] = max(self.peak.get(int(pid), 0), used)
            self._stop.wait(1.0)


class Fleet:
    """A started cluster routed by one policy (``with``: start, warm up; stop on leaving), and
    replays against it; each replay's row."""

    def __init__(self, args: argparse.Namespace, policy: str, log_dir: str | None) -> None:
        worker_args = ["--engine", "torch", "--torch-model", args.model, "--device",
                       args.device, "--max-model-len", str(args.max_model_len),
                       "--gpu-memory-utilization", str(args.gpu_memory_utilization
                                                       or 0.9 / args.workers)]
        if args.max_num_batched_tokens is not None:
            worker_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.kv_memory_gb is not None:
            worker_args += ["--kv-memory-gb", str(args.kv_memory_gb)]
        for flag in ("short_prefill", "short_pass_tokens"):
            if getattr(args, flag) is not None:
                worker_args += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        if args.kv_transfer_secret_file is not None:
            worker_args += ["--kv-transfer-secret-file", args.kv_transfer_secret_file]
        self.args, self.policy = args, policy
        self.cluster = Cluster(args.workers, worker_args=worker_args,
                               router_args=router_args(args, policy), log_dir=log_dir)
        self.processes = ProcessMemory()
        self.ready_s = 0.0

    def __enter__(self) -> Fleet:
        self.processes.__enter__()
        try:
            started = time.perf_counter()
            self.cluster.start(timeout=self.args.ready_timeout)
            warm_up(self.cluster, self.args.warmup_tokens)
            self.ready_s = time.perf_counter() - started
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.cluster.stop()
        finally:
            self.processes.__exit__()

    def reroute(self, policy: str, flags: Sequence[str] = ()) -> None:
        """Replace the router with one routing by ``policy``, ``flags`` after the fleet's own
        router flags (``--kv-fetch off``, say); the workers keep running."""
        self.cluster.replace_router([*router_args(self.args, policy), *flags],
                                    self.args.ready_timeout)
        self.policy = policy

    def reset(self) -> None:
        """Empty every worker's prefix cache (between probes of a capacity search)."""
        for url in worker_urls(self.cluster):
            post_json(f"{url}/reset_prefix_cache", {}, 30)

    def replay(self, requests: Sequence[WorkloadRequest], slo_s: float | None = None
               ) -> dict[str, Any]:
        """Replay ``requests`` against the router; one row (with goodput when ``slo_s``)."""
        urls = worker_urls(self.cluster)
        before = [_metric_sum(u, self.args.requests_metric) for u in urls]
        fetch_before = fetch_counts(self.cluster.url, urls)
        records, makespan = asyncio.run(replay_live(self.cluster.url, requests,
                                                    concurrency=self.args.concurrency))
        after = [_metric_sum(u, self.args.requests_metric) for u in urls]
        fetch_after = fetch_counts(self.cluster.url, urls)
        row = summarize_live(records, makespan, self.policy)
        ok = [r for r in records if r.error is None]
        shares = [a - b for a, b in zip(after, before, strict=True)]
        row.update(
            ready_s=self.ready_s,
            prompt_tok_s=sum(r.prompt_tokens for r in ok) / makespan if makespan else 0.0,
            worker_requests=shares,
            request_imbalance=max(shares) / (sum(shares) / len(shares)) if sum(shares) else 0.0,
            worker_memory=[_worker_memory(u) for u in urls],
            process_peak_bytes=sorted(self.processes.peak.values()),
            fetch={k: fetch_after[k] - fetch_before.get(k, 0.0) for k in fetch_after},
        )
        if slo_s is not None:
            row["goodput_req_s"], row["goodput_prompt_tok_s"] = goodput(
                [r.ttft_s for r in ok], [r.prompt_tokens for r in ok], makespan, slo_s)
        return row


def run_policy(args: argparse.Namespace, policy: str, requests: Sequence[WorkloadRequest],
               log_dir: str | None) -> dict[str, Any]:
    """Start a fresh cluster routed by ``policy``, replay ``requests``, stop it; one row."""
    with Fleet(args, policy, log_dir) as fleet:
        return fleet.replay(requests)


def run_capacity(args: argparse.Namespace, requests: Sequence[WorkloadRequest],
                 prompt_tokens: int) -> dict[str, dict[str, Any]]:
    """``--slo``: per policy, one cluster, and a bisection over loads in ``--capacity-range``
    (:func:`bench.capacity.search_capacity`), every worker's cache emptied before each probe."""
    lo, hi = (float(x) for x in args.capacity_range.split(","))
    span = requests[-1].arrival_s or 1.0
    results = {}
    for policy in args.policies.split(","):
        with Fleet(args, policy, args.log_dir) as fleet:
            def probe(load: float, fleet: Fleet = fleet) -> dict[str, Any]:
                fleet.reset()
                scaled = scale_rate(requests, span / (prompt_tokens / (load * args.cold_rate)))
                row = fleet.replay(scaled, args.slo)
                row.update(load=load, arrival_span_s=scaled[-1].arrival_s)
                print(f"# {json.dumps(row)}", flush=True)
                return row

            results[policy] = search_capacity(probe, slo_s=args.slo, lo=lo, hi=hi,
                                              steps=args.capacity_steps)
    return results


def _table(result: dict[str, Any]) -> str:
    head = (f"{'load':>5} {'policy':>12} {'hit':>6} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
            f"{'e2e p50':>8} {'p99':>7} {'prompt tok/s':>12} {'out tok/s':>9} {'err':>4}  shares")
    source = (f"generator {result['generator']}" if result["generator"] else
              f"trace {result['first']}..{result['first'] + result['count']}")
    lines = [f"{result['workers']} x {result['model']} workers, {source} ({result['requests']} "
             f"requests, "
             f"{result['prompt_tokens']} prompt tokens, {result['output_tokens']} output tokens, "
             f"{result['skipped_long']} too long), "
             f"TTFT in seconds", head]
    for r in result["runs"]:
        lines.append(
            f"{r['load']:>5g} {r['policy']:>12} {r['hit_rate']:>6.1%} {r['ttft_p50_s']:>9.3f} "
            f"{r['ttft_p90_s']:>7.3f} {r['ttft_p99_s']:>7.3f} {r['e2e_p50_s']:>8.2f} "
            f"{r['e2e_p99_s']:>7.2f} {r['prompt_tok_s']:>12.0f} {r['output_tok_s']:>9.0f} "
            f"{r['errors']:>4}  {[int(s) for s in r['worker_requests']]}")
        gib = 2**30
        for i, m in enumerate(r["worker_memory"]):
            lines.append(
                f"      worker {i}: budget {m['memory_budget_bytes'] / gib:.2f} GiB, KV "
                f"{m['memory_kv_bytes'] / gib:.2f}, worst iteration "
                f"{m['memory_iteration_bytes'] / gib:.2f}, graphs "
                f"{m['memory_graph_bytes'] / gib:.2f}, peak reserved "
                f"{m['memory_peak_reserved_bytes'] / gib:.2f} GiB; out-of-memory passes "
                f"{m['out_of_memory_passes']:.0f}, failed iterations "
                f"{m['failed_iterations']:.0f}, recomputed after them "
                f"{m['failure_preemptions']:.0f}, failed requests {m['failed_requests']:.0f}, "
                f"preemptions {m['preemptions']:.0f}, cache releases {m['cache_releases']:.0f}")
        if r["process_peak_bytes"]:
            lines.append("      nvidia-smi, most held per process (GiB): " + ", ".join(
                f"{b / gib:.2f}" for b in r["process_peak_bytes"]))
    summary = result["summary"]
    if any(m["runs"] > 1 for m in summary):
        lines.append("medians over repeats (TTFT p50 range in brackets):")
        for m in summary:
            lines.append(
                f"{m['load']:>5g} {m['policy']:>12} x{m['runs']}: hit {m['hit_rate']:.1%}, TTFT "
                f"mean {m['ttft_mean_s']:.3f} p50 {m['ttft_p50_s']:.3f} [{m['ttft_p50_min_s']:.3f}"
                f"-{m['ttft_p50_max_s']:.3f}] p99 {m['ttft_p99_s']:.3f}")
    for load in sorted({m["load"] for m in summary}):
        med = {m["policy"]: m for m in summary if m["load"] == load}
        if "round_robin" in med and "kv" in med and med["kv"]["ttft_p50_s"] > 0:
            ratio = med["round_robin"]["ttft_p50_s"] / med["kv"]["ttft_p50_s"]
            lines.append(f"load {load:g}: round-robin TTFT p50 / kv TTFT p50 = {ratio:.2f}")
    return "\n".join(lines)


def summarize_repeats(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (load, policy), in first-run order: how many runs, the medians of hit rate and TTFT
    mean / p50 / p99 over them, and the lowest and highest p50."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["load"], r["policy"]), []).append(r)
    out = []
    for (load, policy), rows in groups.items():
        p50s = [r["ttft_p50_s"] for r in rows]
        out.append({
            "load": load, "policy": policy, "runs": len(rows),
            **{k: statistics.median(r[k] for r in rows)
               for k in ("hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s")},
            "ttft_p50_min_s": min(p50s), "ttft_p50_max_s": max(p50s),
        })
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--workers", type=int, default=4, help="torch worker processes (default 4)")
    a("--model", default="llama-1b", help="tiny, llama-1b or a local folder")
    a("--device", default="auto", help="cuda, cpu or auto")
    a("--kv-memory-gb", type=float, default=None, help="KV GiB per worker (default: sized)")
    a("--gpu-memory-utilization", type=float, default=None,
      help="each worker's share of the device (default 0.9 / --workers)")
    a("--generator", default=None,
      help="replay a generated workload (bench.workloads: long_context, multi_turn, ...) "
      "instead of the trace")
    a("--requests", type=int, default=400, help="requests generated (default 400)")
    a("--seed", type=int, default=0, help="the generator's seed")
    a("--trace", type=Path, default=None,
      help="Mooncake trace (default: bench/data)")
    a("--first", type=int, default=0, help="first trace request (default 0)")
    a("--count", type=int, default=600, help="trace requests (default 600)")
    a("--max-model-len", type=int, default=65536, help="longer requests are left out")
    a("--output-scale", type=float, default=1.0,
      help="multiply output lengths (default 1; decode is not what routing saves)")
    a("--loads", default="0.9", help="offered prompt tokens/s over --cold-rate, comma-separated")
    a("--cold-rate", type=float, default=150_000.0, help="the device's cold prefill tokens/s")
    a("--policies", default="round_robin,kv", help="router policies, comma-separated")
    a("--max-num-batched-tokens", type=int, default=None,
      help="each worker's prefill chunk cap (default: the worker's, 8192)")
    a("--short-prefill", type=int, default=None, metavar="TOKENS",
      help="each worker's --short-prefill: prefills with at most TOKENS left go first "
      "(default: the worker's, 0: first come, first served)")
    a("--short-pass-tokens", type=int, default=None, metavar="TOKENS",
      help="each worker's --short-pass-tokens (default: the worker's)")
    a("--kv-transfer-secret-file", default=None, metavar="PATH",
      help="the secret shared by the router and every worker (peer KV fetch; CUDA IPC between "
      "torch workers on one GPU needs it; default: none, fetches over loopback HTTP only)")
    a("--kv-fetch", choices=["auto", "off"], default=None,
      help="the router's --kv-fetch (default: the router's own, auto)")
    a("--mps", choices=MODES, default="auto",
      help="CUDA MPS for the workers: started before them and stopped after (bench.gpu.mps); "
      "auto uses it where nvidia-cuda-mps-control is found (default auto)")
    a("--slo", type=float, default=None, metavar="SECONDS",
      help="capacity mode: per policy, the highest load in --capacity-range whose TTFT p99 "
      "stays under SECONDS, goodput there, and kv's over round-robin's (replaces --loads)")
    a("--capacity-range", default="0.2,1.2", metavar="LO,HI",
      help="capacity mode: the loads searched (default 0.2,1.2)")
    a("--capacity-steps", type=int, default=3, help="capacity mode: bisection steps (default 3)")
    a("--repeats", type=int, default=1,
      help="runs of each load and policy, each on a fresh cluster (default 1)")
    a("--concurrency", type=int, default=2048, help="requests in flight at most")
    a("--warmup-tokens", type=int, default=4096, help="warm-up prompt per worker")
    a("--ready-timeout", type=float, default=300.0, help="seconds for the cluster to start")
    a("--requests-metric", default="kvroute_worker_requests_total",
      help="the workers' request counter in /metrics")
    a("--log-dir", default=None, help="children's logs here (default: this terminal)")
    a("--json", dest="json_path", default=None, help="write the result here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = args.trace or DEFAULT_TRACE
    try:
        if args.generator is None:
            requests, skipped = window(path, args.first, args.count, args.max_model_len,
                                       args.output_scale)
        else:
            requests, skipped = generated(args)
        loads = [float(x) for x in args.loads.split(",")]
        if args.slo is not None:
            lo, hi = (float(x) for x in args.capacity_range.split(","))
            if not (args.slo > 0 and 0 < lo < hi and args.capacity_steps >= 0):
                raise ValueError("--slo must be positive, --capacity-range LO,HI with "
                                 "0 < LO < HI, --capacity-steps at least 0")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not requests or any(load <= 0 for load in loads):
        print("error: an empty window, or a load that is not positive", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"error: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    prompt_tokens = sum(r.input_length for r in requests)
    span = requests[-1].arrival_s or 1.0
    result: dict[str, Any] = {
        "workers": args.workers, "model": args.model, "first": args.first, "count": args.count,
        "generator": args.generator, "gpu_memory_utilization": args.gpu_memory_utilization,
        "requests": len(requests), "skipped_long": skipped, "prompt_tokens": prompt_tokens,
        "cold_rate": args.cold_rate, "kv_memory_gb": args.kv_memory_gb,
        "output_scale": args.output_scale,
        "output_tokens": sum(r.output_length for r in requests), "runs": [],
    }
    with Mps(args.mps) as mps:
        print(f"# CUDA MPS: {mps.status}", flush=True)
        result["mps"] = mps.status
        if args.slo is not None:
            capacity = run_capacity(args, requests, prompt_tokens)
            result["capacity"] = {"slo_s": args.slo, "ratio": sustained_ratio(capacity),
                                  "policies": capacity}
            result["runs"] = [r["row"] for r in capacity.values() if r["row"] is not None]
        else:
            for load in loads:
                scaled = scale_rate(requests, span / (prompt_tokens / (load * args.cold_rate)))
                for repeat in range(args.repeats):
                    for policy in args.policies.split(","):
                        row = run_policy(args, policy, scaled, args.log_dir)
                        row.update(load=load, arrival_span_s=scaled[-1].arrival_s,
                                   repeat=repeat)
                        result["runs"].append(row)
                        print(f"# {json.dumps(row)}", flush=True)
    for row in result["runs"]:
        row.setdefault("repeat", 0)
    result["summary"] = summarize_repeats(result["runs"])
    print(_table(result), flush=True)
    if "capacity" in result:
        print(capacity_table(result["capacity"]["policies"], args.slo,
                             f"load = offered prompt tok/s over {args.cold_rate:.0f}"), flush=True)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0 if all(r["errors"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
