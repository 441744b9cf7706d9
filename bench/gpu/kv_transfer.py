"""Peer KV fetch between torch workers on one GPU: HTTP bytes against CUDA IPC copies.

Run (on a GPU machine, from the repository root)::

    python -m bench.gpu.kv_transfer --blocks 64,256,1024 --repeats 5 --json out.json

It starts three ``kvroute worker --engine torch --device cuda`` processes on the one device
(``--model``'s random weights, llama-1b by default, as :mod:`bench.gpu_routing`): a holder,
a receiver started with ``--no-kv-fetch-ipc`` (its fetches read the
:mod:`workers.torch.kv_wire` message over HTTP) and a receiver with CUDA IPC on (its
fetches copy the holder's blocks device to device, :mod:`workers.http.kv_ipc`), all three
with one fresh ``--kv-transfer-secret-file`` (the IPC path needs it). The holder
computes one long prompt (``--prompt-tokens``); then, for each ``N`` in ``--blocks``, each
receiver in turn, ``--repeats`` times alternated, empties its cache and is sent the prompt's
first ``N`` blocks and one token more with a fetch instruction naming the holder: it fetches
``N`` blocks and computes one token. Reported per transfer and ``N``, from the receivers'
``x-kvroute-fetch-result`` (bytes moved, seconds from the fetch's start to its blocks
committed): the median seconds and GB/s, which transfer each fetch used (the receiver's
``kvroute_worker_kv_fetch_transfers_total``), and whether the receiver's token equals the
holder's for the same prompt (the fetched KV is the holder's). One untimed fetch per
receiver comes first (the IPC receiver maps the holder's pool then).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvroute.up import free_port

__all__ = ["main", "run"]

_BYTES_PER_GB = 1e9


def _request(url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
             timeout: float = 120.0) -> tuple[dict[str, Any], dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json",
                                             **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read()), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url} answered {exc.code}: {exc.read()[:300]!r}") from None


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def _start(name: str, flags: Sequence[str], log_dir: str | None
           ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    out = None
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        out = open(os.path.join(log_dir, f"{name}.log"), "ab")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "worker", "--port",
                                str(port), "--no-events", *flags], stdout=out,
                               stderr=subprocess.STDOUT if out else None,
                               start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def _wait_ready(workers: Sequence[tuple[subprocess.Popen[bytes], str]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(workers)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(pending)} workers were not ready in {timeout:g} s")
        process, url = pending[0]
        if process.poll() is not None:
            raise RuntimeError(f"the worker for {url} exited with {process.returncode}")
        try:
            _request(f"{url}/model_info", timeout=2)
            pending.pop(0)
        except (OSError, ValueError, urllib.error.URLError):
            time.sleep(0.5)


def _result(header: str) -> dict[str, float]:
    if header.startswith("failed"):
        raise RuntimeError(f"a fetch failed: {header}")
    fields = dict(part.split("=", 1) for part in header.split(";"))
    return {"blocks": int(fields["blocks"]), "bytes": int(fields["bytes"]),
            "seconds": float(fields["seconds"])}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the three workers, time the fetches, stop them; the figures as a dict."""
    folder = tempfile.mkdtemp(prefix="kv-transfer-")
    secret = os.path.join(folder, "secret")
    token = secrets.token_hex(32)
    with open(secret, "w") as f:  # the IPC path is served only to peers holding it
        f.write(token)
    common = ["--kv-transfer-secret-file", secret, "--engine", "torch", "--torch-model",
              args.model, "--device", args.device,
              "--block-size", str(args.block_size), "--max-model-len",
              str(args.prompt_tokens + 2 * args.block_size), "--kv-memory-gb",
              str(args.kv_memory_gb), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
              "--kv-fetch-timeout", "120", "--no-cuda-graphs"]
    workers = {"holder": _start("holder", common, args.log_dir),
               "http": _start("receiver-http", [*common, "--no-kv-fetch-ipc"], args.log_dir),
               "cuda_ipc": _start("receiver-ipc", common, args.log_dir)}
    try:
        started = time.perf_counter()
        _wait_ready(list(workers.values()), args.ready_timeout)
        ready_s = time.perf_counter() - started
        holder = workers["holder"][1]
        info, _ = _request(f"{holder}/model_info")
        prompt = [4 + (j * 104729) % 251 for j in range(args.prompt_tokens)]  # any vocabulary
        _request(f"{holder}/v1/completions", {"prompt": prompt, "max_tokens": 1}, timeout=600)
        for transfer in ("http", "cuda_ipc"):  # untimed: the IPC receiver maps the pool
            _request(f"{workers[transfer][1]}/v1/completions",
                     {"prompt": prompt[:4 * args.block_size + 1], "max_tokens": 1},
                     {"x-kvroute-fetch-source": holder, "x-kvroute-fetch-blocks": "4",
                      "x-kvroute-transfer-token": token})
        rows: list[dict[str, Any]] = []
        for n in args.blocks:
            head = prompt[:n * args.block_size + 1]
            reference, _ = _request(f"{holder}/v1/completions",
                                    {"prompt": head, "max_tokens": 1})
            expect = reference["choices"][0]["text"]
            runs: dict[str, list[dict[str, float]]] = {"http": [], "cuda_ipc": []}
            same = {"http": 0, "cuda_ipc": 0}
            before = _metric(workers["cuda_ipc"][1],
                             'kvroute_worker_kv_fetch_transfers_total{transfer="cuda_ipc"}')
            for _ in range(args.repeats):
                for transfer in ("http", "cuda_ipc"):
                    url = workers[transfer][1]
                    _request(f"{url}/reset_prefix_cache", {})
                    answer, headers = _request(
                        f"{url}/v1/completions", {"prompt": head, "max_tokens": 1},
                        {"x-kvroute-fetch-source": holder, "x-kvroute-fetch-blocks": str(n),
                         "x-kvroute-transfer-token": token})
                    runs[transfer].append(_result(headers["x-kvroute-fetch-result"]))
                    same[transfer] += answer["choices"][0]["text"] == expect
            over_ipc = _metric(workers["cuda_ipc"][1],
                               'kvroute_worker_kv_fetch_transfers_total{transfer="cuda_ipc"}'
                               ) - before
            for transfer, fetched in runs.items():
                seconds = statistics.median(r["seconds"] for r in fetched)
                moved = statistics.median(r["bytes"] for r in fetched)
                best = max(r["bytes"] / r["seconds"] for r in fetched)
                rows.append({"transfer": transfer, "blocks": n, "bytes": moved,
                             "seconds_p50": seconds,
                             "gb_per_s_p50": moved / seconds / _BYTES_PER_GB,
                             "gb_per_s_max": best / _BYTES_PER_GB,
                             "fetches": len(fetched), "same_token": same[transfer],
                             "over_cuda_ipc": int(over_ipc) if transfer == "cuda_ipc" else 0})
        return {"model": args.model, "block_size": args.block_size,
                "prompt_tokens": args.prompt_tokens, "ready_s": ready_s,
                "holder_kv_fetch": info.get("kv_fetch"), "rows": rows}
    finally:
        for process, _ in workers.values():
            process.terminate()
        for process, _ in workers.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(folder, ignore_errors=True)


def table(result: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    lines = ["| transfer | blocks | MB | seconds (p50) | GB/s (p50) | GB/s (best) | "
             "fetches over CUDA IPC | same token |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['transfer']} | {r['blocks']} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['seconds_p50']:.4f} | {r['gb_per_s_p50']:.1f} | "
                     f"{r['gb_per_s_max']:.1f} | "
                     f"{r['over_cuda_ipc'] if r['transfer'] == 'cuda_ipc' else '-'} | "
                     f"{r['same_token']}/{r['fetches']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run, print the table (and write ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", help="tiny, llama-1b or a local folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32768,
                   help="the holder's prompt; every N in --blocks must be below its blocks")
    p.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")],
                   default=[64, 256, 1023], help="blocks per fetch, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-memory-gb", type=float, default=4.0, help="KV GiB per worker")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", default=None, help="workers' logs (default: this output)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if max(args.blocks) * args.block_size >= args.prompt_tokens:
        p.error("every --blocks count must leave the prompt's last block to compute")
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
