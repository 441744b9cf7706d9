"""The commands as a user runs them: clean shutdown on SIGTERM, and ``kvroute up`` serving a
request through the router, then leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvroute.up import free_port
from tests.support.eventually import eventually_blocking

pytestmark = pytest.mark.process  # starts child processes


def children_of(pid: int) -> set[int]:
    """Every descendant of ``pid``, read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_http(url: str, timeout: float = 30.0) -> None:
    eventually_blocking(lambda: httpx.get(url, timeout=1).status_code == 200,
                        f"{url} to answer", timeout, interval=0.05, tolerate=(httpx.HTTPError,))


def test_worker_exits_cleanly_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "worker", "--port", str(port),
                             "--events-port", str(free_port()), "--replay-port",
                             str(free_port())], stderr=subprocess.PIPE)
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        # uvicorn shuts down gracefully, then re-raises the signal for the exit status
        assert proc.returncode in (0, -signal.SIGTERM)
        assert b"Application shutdown complete" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_up_serves_a_request_and_sigterm_leaves_no_orphans() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "up", "--workers", "2",
                             "--port", str(port), "--status-interval", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("kvroute is up"):
                break
        assert lines and lines[-1].startswith(f"kvroute is up: http://127.0.0.1:{port}")
        example = proc.stdout.readline() + proc.stdout.readline()
        assert "curl" in example and "/v1/completions" in example
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=10,
                       json={"model": "kvroute-sim", "prompt": "Hello, kvroute!",
                             "max_tokens": 4})
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 4
        status = proc.stdout.readline()
        assert "workers 2/2 healthy" in status
        spawned = children_of(proc.pid)
        assert len(spawned) >= 3, "a router and two workers"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        eventually_blocking(lambda: [p for p in spawned if alive(p)],
                            "no child to outlive kvroute up", until=lambda left: not left)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
