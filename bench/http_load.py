"""A small closed-loop HTTP load generator and process launcher for the service benchmarks.

``latency(url, body, n)`` sends ``n`` requests one after another over one kept-alive
connection and returns per-request seconds; ``throughput(url, body, connections, seconds)``
keeps ``connections`` requests in flight for ``seconds`` and returns requests per second.
Both use aiohttp's client (the fast one here, see ``router/http/proxy.py``). :func:`spawn` starts a
``kvroute`` subcommand on 127.0.0.1 and waits for its health endpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import aiohttp

__all__ = ["latency", "process_cpu_seconds", "spawn", "stop", "throughput", "wrk_throughput"]


async def _latency(url: str, body: dict[str, Any], n: int, warmup: int) -> list[float]:
    connector = aiohttp.TCPConnector(limit=1)
    out: list[float] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(n + warmup):
            started = time.perf_counter()
            async with session.post(url, json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url} answered {r.status}")
            if i >= warmup:
                out.append(time.perf_counter() - started)
    return out


def latency(url: str, body: dict[str, Any], n: int = 500, warmup: int = 50) -> list[float]:
    """Seconds per request, sequential over one connection."""
    return asyncio.run(_latency(url, body, n, warmup))


async def _throughput(url: str, body: dict[str, Any], connections: int, seconds: float
                      ) -> tuple[int, int]:
    connector = aiohttp.TCPConnector(limit=connections)
    done = failed = 0
    deadline = time.perf_counter() + seconds

    async def loop(session: aiohttp.ClientSession) -> None:
        nonlocal done, failed
        while time.perf_counter() < deadline:
            async with session.post(url, json=body) as r:
                await r.read()
                if r.status == 200:
                    done += 1
                else:
                    failed += 1

    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(loop(session) for _ in range(connections)))
    return done, failed


def throughput(url: str, body: dict[str, Any], connections: int = 16, seconds: float = 5.0
               ) -> tuple[float, int]:
    """Requests per second with ``connections`` in flight, and how many failed."""
    started = time.perf_counter()
    done, failed = asyncio.run(_throughput(url, body, connections, seconds))
    return done / (time.perf_counter() - started), failed


def run_wrk(url: str, body: dict[str, Any], connections: int, seconds: float,
            *extra: str) -> tuple[str, float]:
    """POST ``body`` with ``wrk`` (a C load generator that leaves more of this 2-core machine
    to the servers than the Python one); returns its output and the requests per second.

    Raises:
        RuntimeError: wrk printed no rate, or some answers were not 2xx.
    """
    script = (f"wrk.method = 'POST'\nwrk.body = {json.dumps(json.dumps(body))}\n"
              "wrk.headers['Content-Type'] = 'application/json'\n")
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as f:
        f.write(script)
        f.flush()
        out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{max(1, round(seconds))}s",
                              *extra, "-s", f.name, url], capture_output=True, text=True,
                             timeout=seconds + 60, check=True).stdout
    found = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if found is None or "Non-2xx" in out:
        raise RuntimeError(f"wrk run failed:\n{out}")
    return out, float(found.group(1))


def wrk_throughput(url: str, body: dict[str, Any], connections: int = 16,
                   seconds: float = 5.0) -> float | None:
    """Requests per second measured by ``wrk``, or None when wrk is not installed."""
    if shutil.which("wrk") is None:
        return None
    return run_wrk(url, body, connections, seconds)[1]


def wrk_cpu(url: str, body: dict[str, Any], connections: int, seconds: float, pid: int
            ) -> tuple[float, float] | None:
    """Requests per second measured by ``wrk``, and the CPU seconds the process ``pid`` spent
    per request meanwhile; None when wrk is not installed."""
    if shutil.which("wrk") is None:
        return None
    before = process_cpu_seconds(pid)
    out, rate = run_wrk(url, body, connections, seconds)
    spent = process_cpu_seconds(pid) - before
    found = re.search(r"(\d+) requests in", out)
    if found is None or not int(found.group(1)):
        raise RuntimeError(f"wrk printed no request count:\n{out}")
    return rate, spent / int(found.group(1))


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds the process ``pid`` has used so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(args: list[str], url: str, health: str = "/health", timeout: float = 30.0,
          niceness: int = 0, log: str | None = None) -> subprocess.Popen[bytes]:
    """Start ``kvroute <args>`` (under ``nice -n niceness`` when not 0) and wait until
    ``url + health`` answers 200; ``log``: :func:`launch`'s."""
    return wait_ready(launch(args, niceness, log), url + health, f"kvroute {' '.join(args)}",
                      timeout)


def launch(args: list[str], niceness: int = 0, log: str | None = None
           ) -> subprocess.Popen[bytes]:
    """Start ``kvroute <args>`` in a session of its own (under ``nice -n niceness`` when not
    0), its output discarded, or, given a ``log`` path, its log at level info appended there;
    :func:`wait_ready` waits for it, :func:`stop` stops it."""
    nice = ["nice", "-n", str(niceness)] if niceness else []
    level = "warning" if log is None else "info"
    with open(log or os.devnull, "ab") as out:
        return subprocess.Popen([*nice, sys.executable, "-m", "kvroute.cli", *args,
                                 "--log-level", level],
                                stdout=subprocess.DEVNULL, stderr=out,
                                start_new_session=True)


def wait_ready(proc: subprocess.Popen[bytes], url: str, name: str, timeout: float
               ) -> subprocess.Popen[bytes]:
    """Wait until ``url`` answers 200 and return ``proc``; stop it and raise RuntimeError
    (naming it ``name``) when it exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"{name} was not ready in {timeout}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, SIGKILL after 5 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
