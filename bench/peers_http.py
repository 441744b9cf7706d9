"""kvroute beside the Rust routers on short requests: ``python -m bench.peers_http [--rounds 3]
[--seconds 5] [--router-cpu 1] [--kvroute DIR ...] [--json]``.

Every router forwards to the same two backends, one nginx process answering each
``/v1/completions`` with a fixed completion (so the backend costs next to nothing), and
routes by prefix: kvroute ``--policy kv`` (the workers described as ``engine=vllm``: nginx
serves the ``/v1/models`` and ``/metrics`` a vLLM server would), and, when ``make peers`` has
put them in ``.venv-peers``, sglang-router (``launch --policy cache_aware``) and vllm-router
(``--policy cache_aware``). Each router runs pinned to one core (``taskset -c
--router-cpu``); nginx and wrk run on the other cores. The body is a completions request with
a 1,000-byte prompt (1,000 tokens under the byte-level tokenizer), one of 16 that share
nothing, in turn.

Each round measures every target in turn (the order turns by one each round, so no router is
always measured first): ``wrk`` at 64 connections for ``--seconds`` (requests per second, and
the router's CPU time over that run, user plus system across its processes, per request), then
``wrk`` on one connection (its p50 less nginx's own over one connection is the added p50).
The table gives the median over rounds, and the range where rounds differ by more than a
tenth. ``--kvroute DIR`` (repeatable) runs kvroute from each checkout named, as
``python -m kvroute.cli`` in that folder, to compare two versions in one run.

On the 2-core VM (load average 2-4 from other jobs), ``python -m bench.peers_http --rounds 5
--seconds 5 --kvroute CHECKOUT-BEFORE --kvroute .`` printed (kvroute at main's c121843, and
with one timer for every first-byte deadline, the core's regrouping from plain figures and
the request id added in place; medians over 5 rounds):

| router | added p50 (ms) | req/s, 64 connections | CPU per request (µs) |
|---|---|---|---|
| nginx direct | - | 79,018 (59,878-85,419) | - |
| kvroute --policy kv, before | 0.47 (0.35-1.21) | 2,813 (1,745-2,960) | 248 (235-268) |
| kvroute --policy kv | 0.39 (0.36-1.21) | 2,834 (2,087-3,542) | 243 |
| sglang-router 0.3.2 cache_aware | 0.23 (0.21-0.43) | 6,862 (5,265-8,046) | 94 |
| vllm-router 0.1.17 cache_aware | 0.33 (0.30-0.38) | 4,480 (3,482-5,337) | 149 |

The before and after differ by less than the rounds' spread (``bench/router.py``'s docstring
has each cut's own figure). docs/experiments.md keeps the earlier runs (kvroute 767 -> 424 µs at
load 2.5-5, 738 -> 370 at load 9-10, 323 -> 258 at load 7 with the server's own request
cycle, and two more of that pair: 373 -> 261 at load 7, 363 -> 287 at load 5).
On a loaded machine the figures move by a tenth or more between rounds; compare within one
run. The added p50 is measured on one connection, so it is the router's own latency, not
queueing at 64 connections.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.figures import percentile
from bench.http_load import stop, wait_ready
from kvroute.up import free_port

NGINX = "/usr/sbin/nginx"
PEERS_BIN = Path(".venv-peers/bin")
PROMPT_BYTES = 1000
PROMPTS = 16
MODEL = "bench-model"

#: The answer nginx gives to every completion, as a vLLM server would shape it.
_COMPLETION = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "text": " fixed", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": PROMPT_BYTES, "completion_tokens": 1,
              "total_tokens": PROMPT_BYTES + 1}})
_MODELS = json.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "owned_by": "bench", "max_model_len": 8192}]})
#: What kvroute's vLLM adapter reads (router/fleet/engines/stock.py).
_METRICS = ("vllm:num_requests_running{model_name=\"m\"} 0\\n"
            "vllm:num_requests_waiting{model_name=\"m\"} 0\\n"
            "vllm:kv_cache_usage_perc{model_name=\"m\"} 0\\n"
            "vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"10000\"} 1\\n")


def _nginx_conf(folder: Path, ports: list[int]) -> str:
    listens = "".join(f"    listen 127.0.0.1:{p} reuseport;\n" for p in ports)
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp = "".join(f"  {k}_temp_path {folder}/{k};\n"
                   for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""{user}worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 10000000;
  keepalive_timeout 60s;
  client_body_buffer_size 64k;
{temp}  server {{
{listens}    default_type application/json;
    location = /v1/completions {{ return 200 '{_COMPLETION}'; }}
    location = /v1/models {{ return 200 '{_MODELS}'; }}
    location = /metrics {{ default_type text/plain; return 200 '{_METRICS}'; }}
    location / {{ return 200 '{{}}'; }}
  }}
}}
"""


@contextlib.contextmanager
def nginx(ports: list[int], cpus: str) -> Iterator[None]:
    """nginx answering on ``ports`` (one worker process, on ``cpus``) until the block ends."""
    with tempfile.TemporaryDirectory(prefix="kvroute-nginx-") as d:
        folder = Path(d)
        (folder / "nginx.conf").write_text(_nginx_conf(folder, ports))
        proc = subprocess.Popen(["taskset", "-c", cpus, NGINX, "-p", d, "-c", "nginx.conf",
                                 "-e", f"{d}/error.log", "-g", "daemon off;"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            wait_ready(proc, f"http://127.0.0.1:{ports[0]}/v1/models", "nginx", 10)
            yield
        finally:
            stop(proc)


@dataclass
class Target:
    """One thing wrk is pointed at, and what it measured in each round."""

    name: str
    url: str
    proc: subprocess.Popen[bytes] | None = None
    rps: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)


def _router_commands(args: argparse.Namespace, backends: list[str]
                     ) -> list[tuple[str, list[str], str | None, str]]:
    """(name, command with its ``--port``, working folder, health path) of each router."""
    out: list[tuple[str, list[str], str | None, str]] = []
    for checkout in args.kvroute or ["."]:
        cmd = [sys.executable, "-m", "kvroute.cli", "router", "--port", str(free_port()),
               "--policy", "kv", "--log-level", "warning"]
        for b in backends:
            cmd += ["--worker", f"{b},engine=vllm"]
        name = "kvroute --policy kv" + (f" ({checkout})" if args.kvroute else "")
        out.append((name, cmd, checkout, "/ready"))
    sglang, vllm = PEERS_BIN / "sglang-router", PEERS_BIN / "vllm-router"
    # Each serves its own Prometheus port (29000 for both by default).
    if sglang.exists() and not args.no_peers:
        out.append(("sglang-router cache_aware",
                    [str(sglang.resolve()), "launch", "--host", "127.0.0.1",
                     "--port", str(free_port()), "--prometheus-port", str(free_port()),
                     "--policy", "cache_aware", "--log-level", "warn", "--worker-urls",
                     *backends], None, "/health"))
    if vllm.exists() and not args.no_peers:
        out.append(("vllm-router cache_aware",
                    [str(vllm.resolve()), "--host", "127.0.0.1", "--port", str(free_port()),
                     "--prometheus-port", str(free_port()), "--policy", "cache_aware",
                     "--log-level", "warning", "--worker-urls", *backends], None, "/health"))
    return out


def _group_cpu_seconds(pgid: int) -> float:
    """User plus system CPU seconds of every process in the process group ``pgid``."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _wrk_script(folder: Path) -> Path:
    bodies = []
    for i in range(PROMPTS):
        words = f"prompt {i} shares nothing with the others: " + " ".join(
            f"w{i}x{j}" for j in range(PROMPT_BYTES))
        bodies.append(json.dumps({"model": MODEL, "prompt": words[:PROMPT_BYTES],
                                  "max_tokens": 1}))
    script = folder / "bodies.lua"
    script.write_text(
        "wrk.method = 'POST'\nwrk.headers['Content-Type'] = 'application/json'\n"
        f"bodies = {{{', '.join(json.dumps(b) for b in bodies)}}}\n"
        "i = 0\nrequest = function()\n  i = i % #bodies + 1\n"
        "  return wrk.format(nil, nil, nil, bodies[i])\nend\n")
    return script


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _wrk(url: str, script: Path, connections: int, seconds: float, cpus: str
         ) -> tuple[int, float, float]:
    """Run wrk; return its requests, requests per second and p50 in ms."""
    threads = min(connections, 2)
    out = subprocess.run(["taskset", "-c", cpus, "wrk", f"-t{threads}", f"-c{connections}",
                          f"-d{max(1, round(seconds))}s", "--timeout", "10s", "--latency",
                          "-s", str(script),
                          f"{url}/v1/completions"],
                         capture_output=True, text=True, timeout=seconds + 60,
                         check=True).stdout
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    count = re.search(r"(\d+) requests in", out)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)\b", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+)", out)
    if (rate is None or count is None or p50 is None or "Non-2xx" in out
            or (errors is not None and any(int(n) for n in errors.groups()))):
        raise RuntimeError(f"wrk against {url} failed:\n{out}")
    return int(count.group(1)), float(rate.group(1)), float(p50.group(1)) * _UNITS[p50.group(2)]


def _measure(target: Target, script: Path, seconds: float, cpus: str) -> None:
    before = _group_cpu_seconds(target.proc.pid) if target.proc else 0.0
    done, rate, _ = _wrk(target.url, script, 64, seconds, cpus)
    if target.proc is not None:
        spent = _group_cpu_seconds(target.proc.pid) - before
        target.cpu_us.append(spent / done * 1e6)
    target.rps.append(rate)
    _, _, p50 = _wrk(target.url, script, 1, max(2.0, seconds / 2), cpus)
    target.p50_ms.append(p50)


def _cell(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    mid, lo, hi = percentile(values, 50), min(values), max(values)
    text = format(mid, fmt)
    if hi - lo > 0.1 * abs(mid):
        text += f" ({format(lo, fmt)}-{format(hi, fmt)})"
    return text


def run(args: argparse.Namespace) -> list[Target]:
    """Start nginx and the routers, measure ``args.rounds`` rounds, stop everything."""
    cpu = str(args.router_cpu)
    others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != args.router_cpu)
    others = others or cpu
    ports = [free_port(), free_port()]
    backends = [f"http://127.0.0.1:{p}" for p in ports]
    direct = Target("nginx direct", backends[0])
    targets = [direct]
    with nginx(ports, others), tempfile.TemporaryDirectory() as d:
        script = _wrk_script(Path(d))
        try:
            for name, cmd, cwd, health in _router_commands(args, backends):
                url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
                log = Path(d) / f"router{len(targets)}.log"
                with log.open("wb") as sink:
                    proc = subprocess.Popen(["taskset", "-c", cpu, *cmd], cwd=cwd,
                                            stdout=sink, stderr=subprocess.STDOUT,
                                            start_new_session=True)
                try:
                    targets.append(Target(name, url, wait_ready(proc, url + health, name, 60)))
                except RuntimeError:
                    print(log.read_text()[-2000:], file=sys.stderr)
                    raise
            time.sleep(2)  # every router has polled its workers once
            for r in range(args.rounds):
                turn = r % len(targets)
                for target in targets[turn:] + targets[:turn]:
                    _measure(target, script, args.seconds, others)
        finally:
            for target in targets:
                if target.proc is not None:
                    stop(target.proc)
    base = percentile(direct.p50_ms, 50)
    for target in targets:
        target.p50_ms = [p - base for p in target.p50_ms] if target is not direct else []
    return targets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="seconds of each 64-connection run (default 5)")
    parser.add_argument("--router-cpu", type=int, default=1,
                        help="the core every router is pinned to (default 1)")
    parser.add_argument("--kvroute", action="append", metavar="DIR",
                        help="a kvroute checkout to run (repeatable; default: this folder)")
    parser.add_argument("--no-peers", action="store_true",
                        help="kvroute only, even where .venv-peers has the Rust routers")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None or not os.path.exists(NGINX):
        raise SystemExit("bench.peers_http needs wrk and nginx (apt-get install wrk nginx)")
    if args.router_cpu not in os.sched_getaffinity(0):
        raise SystemExit(f"--router-cpu {args.router_cpu} is not a core this process may use")
    targets = run(args)
    if args.json:
        print(json.dumps({t.name: {"added_p50_ms": t.p50_ms, "rps": t.rps,
                                   "cpu_us_per_request": t.cpu_us} for t in targets}))
        return
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds; "
          f"routers on core {args.router_cpu}")
    print("| router | added p50 (ms) | req/s, 64 connections | CPU per request (µs) |")
    print("|---|---|---|---|")
    for t in targets:
        print(f"| {t.name} | {_cell(t.p50_ms, '.2f')} | {_cell(t.rps, ',.0f')} | "
              f"{_cell(t.cpu_us, ',.0f')} |")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
