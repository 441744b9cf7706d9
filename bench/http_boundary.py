"""Figures for the router's HTTP boundary under hostile input: memory for a huge body, and
event-loop stalls while huge prompts arrive.

1. ``rss``: one 1 GiB body streamed (chunked) to the router's ``/v1/completions`` and one of
   512 MiB to the worker's; prints each one's peak resident memory (``VmHWM``) before and
   after, and its resident memory afterwards.
2. ``health``: ``/health`` latency, idle and while 4 clients each send a 50 MB completions
   prompt (repeated for ``--rounds``); prints the p50 and p99 of each. One ``/health`` is sent
   every 20 ms whether or not the earlier ones have been answered.

A sim worker and the router run as ``kvroute`` subprocesses of the tree given by ``--repo``
(default: this one), so the same script measures any checkout.

    python -m bench.http_boundary [--repo PATH] [--which rss,health]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp

GiB, MB = 1024**3, 1000**2


def _spawn(repo: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return subprocess.Popen([sys.executable, "-m", "kvroute.cli", *args], cwd=repo, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _wait(port: int, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"127.0.0.1:{port}{path} not ready in {timeout}s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _post(port: int, head_extra: str, body_parts: list[bytes] | None, chunked_total: int = 0
          ) -> int:
    """POST to /v1/completions; return the status (0 if the connection dropped first)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: "
                      f"application/json\r\n{head_extra}\r\n").encode())
        try:
            if body_parts is not None:
                for part in body_parts:
                    sock.sendall(part)
            else:
                piece = b" " * (1024 * 1024)
                framed = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
                for _ in range(chunked_total // len(piece)):
                    sock.sendall(framed)
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # refused and closed mid-body: the answer is already waiting
        answer = sock.recv(64)
        return int(answer.split()[1]) if answer else 0
    except OSError:
        return 0
    finally:
        sock.close()


def rss(name: str, pid: int, port: int, size: int) -> None:
    """Figure 1, for the server ``name`` at ``pid`` and ``port``."""
    before = _status_kb(pid, "VmHWM")
    started = time.perf_counter()
    status = _post(port, "Transfer-Encoding: chunked\r\n", None, chunked_total=size)
    took = time.perf_counter() - started
    time.sleep(1.0)
    print(f"rss: {size / GiB:g} GiB chunked body -> {status} in {took:.1f} s; {name} peak RSS "
          f"{before / 1024:.0f} MiB before, {_status_kb(pid, 'VmHWM') / 1024:.0f} MiB "
          f"after; RSS afterwards {_status_kb(pid, 'VmRSS') / 1024:.0f} MiB")


def _health_times(port: int, stop: threading.Event, out: list[float]) -> None:
    """Open loop: a ``/health`` request every 20 ms whatever the earlier ones are doing, so
    that a stall of the router's event loop delays every request sent during it (a closed
    loop would send one request per stall and count it once)."""

    async def one(session: aiohttp.ClientSession) -> None:
        started = time.perf_counter()
        try:
            async with session.get(f"http://127.0.0.1:{port}/health") as r:
                await r.read()
        except aiohttp.ClientError:  # a kept-alive connection closed as it was reused
            return
        out.append(time.perf_counter() - started)

    async def run() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = []
            while not stop.is_set():
                tasks.append(asyncio.create_task(one(session)))
                await asyncio.sleep(0.02)
            await asyncio.gather(*tasks)

    asyncio.run(run())


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 1 else float("nan")


def health(port: int, rounds: int) -> None:
    """Figure 2."""
    idle: list[float] = []
    stop = threading.Event()
    stop.set()
    conn_stop = threading.Event()
    poller = threading.Thread(target=_health_times, args=(port, conn_stop, idle))
    poller.start()
    time.sleep(1.0)
    conn_stop.set()
    poller.join()
    prompt = json.dumps({"model": "kvroute-sim", "prompt": "a" * (50 * MB),
                         "max_tokens": 1}).encode()
    busy: list[float] = []
    statuses: list[int] = []
    stop = threading.Event()
    poller = threading.Thread(target=_health_times, args=(port, stop, busy))
    poller.start()
    started = time.perf_counter()
    for _ in range(rounds):
        senders = [threading.Thread(target=lambda: statuses.append(
            _post(port, f"Content-Length: {len(prompt)}\r\n", [prompt]))) for _ in range(4)]
        for s in senders:
            s.start()
        for s in senders:
            s.join()
    took = time.perf_counter() - started
    stop.set()
    poller.join()
    print(f"health: idle p50 {_p(idle, 50):.1f} ms p99 {_p(idle, 99):.1f} ms "
          f"({len(idle)} polls); under 4 concurrent 50 MB prompts x{rounds} "
          f"(answers {sorted(set(statuses))}, {took:.1f} s) p50 {_p(busy, 50):.1f} ms "
          f"p99 {_p(busy, 99):.1f} ms max {max(busy) * 1000:.0f} ms ({len(busy)} polls)")


def main() -> None:
    """Start a worker and a router from ``--repo`` and print the chosen figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--which", default="rss,health")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    wport, rport = _free_port(), _free_port()
    worker = _spawn(args.repo, "worker", "--port", str(wport), "--no-events")
    router = None
    try:
        _wait(wport, "/health")
        router = _spawn(args.repo, "router", "--port", str(rport), "--worker",
                        f"http://127.0.0.1:{wport}")
        _wait(rport, "/ready")
        if "rss" in args.which:
            rss("router", router.pid, rport, GiB)
            rss("worker", worker.pid, wport, GiB // 2)
        if "health" in args.which:
            health(rport, args.rounds)
    finally:
        for proc in (router, worker):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
