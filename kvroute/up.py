"""``kvroute up``: the router and N simulated workers on this machine, with one command.

Starts each worker and then the router as child processes on 127.0.0.1 with free ports (or
ports from ``--worker-ports``), waits until the router is ready, prints the endpoint and a
request to paste, then a compact status line. A worker that dies is restarted on the same
ports (:mod:`kvroute.restarts`: bounded, with backoff) or, past the bound, reported and left
down; the router dying ends the cluster. Ctrl-C or SIGTERM, during start-up too, stops every
child it started: SIGTERM first, SIGKILL for any that has not exited within a few seconds;
children also die with this process (``PR_SET_PDEATHSIG``), so none is orphaned even if
``kvroute up`` itself is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.restarts import RestartSchedule

__all__ = ["Cluster", "free_port", "run_up"]

_PR_SET_PDEATHSIG = 1


#: Where :func:`free_port` draws from: up to the kernel's ephemeral range (below).
PORTS_FROM = 20000
_handed_out: set[int] = set()
_rng = random.Random()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, that no outgoing connection can take before the
    caller binds it, and that this process has not handed out before.

    Binding port 0 gives a port from the kernel's ephemeral range, which every outgoing
    connection draws its local port from: between that pick and a child process's bind, one
    of them could take it (seen as a worker's ``EADDRINUSE`` in the end-to-end tests). So the
    port comes from ``[PORTS_FROM, start of the ephemeral range)``, where no outgoing
    connection goes, and the port-0 way is left for when that span is full or missing.

    ``KVROUTE_FREE_PORTS=LOW-HIGH`` narrows the span to ``[LOW, HIGH)``: the test suite gives
    each of its parallel runners a span of its own, which the processes it starts inherit, so
    no two runners hand out one port.

    Raises:
        ValueError: ``KVROUTE_FREE_PORTS`` is set but is not such a span.
    """
    low, high = _span()
    for _ in range(200 if high - low >= 1000 else 0):
        port = _rng.randrange(low, high)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _span() -> tuple[int, int]:
    """``[low, high)`` that :func:`free_port` draws from."""
    text = os.environ.get("KVROUTE_FREE_PORTS")
    if text is None:
        return PORTS_FROM, _ephemeral_start()
    low, sep, high = text.partition("-")
    try:
        span = int(low), int(high)
    except ValueError:
        span = (0, 0)
    if not sep or not 1024 <= span[0] < span[1] <= 65536:
        raise ValueError(f"KVROUTE_FREE_PORTS must be LOW-HIGH with 1024 <= LOW < HIGH <= "
                         f"65536, not {text!r}")
    return span


def _bindable(port: int) -> bool:
    """Whether a TCP socket can bind ``port`` on 127.0.0.1 right now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768, its default, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _get_json(url: str, timeout: float = 2.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    args: list[str]


class Cluster:
    """A router and its workers as child processes of this one.

    Args:
        workers: how many sim workers.
        port: the router's port (0: a free one).
        worker_args: extra flags for every worker.
        router_args: extra flags for the router.
        log_dir: where children's output goes (None: inherit this process's).
        worker_ports: the ports the workers take, three each (HTTP, events, replay), in
            order, skipping any in use (None: free ports anywhere).

    Raises:
        ValueError: no worker, or ``worker_ports`` too small for them.
    """

    def __init__(self, workers: int, port: int = 0, worker_args: Sequence[str] = (),
                 router_args: Sequence[str] = (), log_dir: str | None = None,
                 worker_ports: range | None = None) -> None:
        if workers < 1:
            raise ValueError("at least one worker")
        if worker_ports is not None and len(worker_ports) < 3 * workers:
            raise ValueError(f"--worker-ports {worker_ports.start}-{worker_ports.stop - 1} "
                             f"holds {len(worker_ports)} ports; {workers} workers need "
                             f"{3 * workers} (HTTP, events and replay each)")
        self.worker_ports = worker_ports
        self.workers = workers
        self.port = port or free_port()
        # A port the caller chose is not bound until the router starts, after the workers:
        # without this, a worker's draw could take it and the router would fail to bind.
        _handed_out.add(self.port)
        self.worker_args = list(worker_args)
        self.router_args = list(router_args)
        self.log_dir = log_dir
        self.children: list[Child] = []

    @property
    def url(self) -> str:
        """The router's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def _ports(self) -> list[int]:
        """Three ports per worker."""
        if self.worker_ports is None:
            return [free_port() for _ in range(3 * self.workers)]
        found = [p for p in self.worker_ports
                 if p != self.port and _bindable(p)][: 3 * self.workers]
        if len(found) < 3 * self.workers:
            raise RuntimeError(f"--worker-ports has {len(found)} ports free; {self.workers} "
                               f"workers need {3 * self.workers}")
        return found

    def _spawn(self, name: str, args: list[str], url: str) -> Child:
        out = None
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        process = subprocess.Popen([sys.executable, "-m", "kvroute.cli", *args], stdout=out,
                                   stderr=subprocess.STDOUT if out else None,
                                   preexec_fn=_die_with_parent, start_new_session=True)
        child = Child(name, process, url, args)
        self.children.append(child)
        return child

    def restart(self, child: Child) -> Child:
        """Start ``child`` again with the same arguments (and so the same ports)."""
        self.children.remove(child)
        return self._spawn(child.name, child.args, child.url)

    def start(self, timeout: float = 60.0) -> None:
        """Start every worker, then the router; return once the router is ready.

        Raises:
            RuntimeError: a child exited or the router was not ready in time.
        """
        urls = []
        ports = self._ports()
        for i in range(self.workers):
            port, events, replay = ports[3 * i: 3 * i + 3]
            url = f"http://127.0.0.1:{port}"
            self._spawn(f"worker-{i}", ["worker", "--port", str(port), "--events-port",
                                        str(events), "--replay-port", str(replay),
                                        *self.worker_args], url)
            urls.append(url)
        router = ["router", "--port", str(self.port)]
        for url in urls:
            router += ["--worker", url]
        self._spawn("router", [*router, *self.router_args], self.url)
        self.wait_ready(timeout)

    def replace_router(self, router_args: Sequence[str], timeout: float = 60.0) -> None:
        """Stop the router and start one with ``router_args`` on a fresh port over the same
        workers (they keep running, caches and all); return once it is ready.

        Raises:
            RuntimeError: a child exited or the new router was not ready in time.
        """
        old = next(c for c in self.children if c.name == "router")
        if old.process.poll() is None:
            old.process.send_signal(signal.SIGTERM)
            try:
                old.process.wait(10.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(old.process.pid, signal.SIGKILL)
                old.process.wait()
        self.children.remove(old)
        self.port, self.router_args = free_port(), list(router_args)
        router = ["router", "--port", str(self.port)]
        for child in self.children:
            if child.name.startswith("worker-"):
                router += ["--worker", child.url]
        self._spawn("router", [*router, *self.router_args], self.url)
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Wait until the router reports every worker healthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in self.children:
                if child.process.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with {child.process.returncode}")
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                ready = _get_json(f"{self.url}/ready", 1.0)
                if ready.get("workers") == self.workers:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the router was not ready within {timeout}s")

    def status(self) -> str:
        """One line: workers healthy, indexed blocks, requests."""
        try:
            workers = _get_json(f"{self.url}/workers")
        except (OSError, ValueError):
            return "router not answering"
        states = [w["state"] for w in workers["workers"]]
        healthy = states.count("healthy")
        return (f"workers {healthy}/{len(states)} healthy | "
                f"index {workers['index']['blocks']} blocks")

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every child (router first), then SIGKILL any left after ``grace``."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children:
            left = max(0.0, deadline - time.monotonic())
            try:
                child.process.wait(left)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
        self.children.clear()


def _example(url: str) -> str:
    body = json.dumps({"model": "kvroute-sim", "prompt": "Hello, kvroute!", "max_tokens": 16})
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


class _Interrupted(Exception):
    """Ctrl-C or SIGTERM while the cluster was starting."""


def router_port(flag: int | None, env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """The router's port: ``--port``, else ``KVROUTE_PORT`` (as ``kvroute router`` reads it),
    else the router's default.

    Raises:
        ValueError: ``KVROUTE_PORT`` is not a port.
    """
    if flag is not None:
        return flag
    raw = env.get("KVROUTE_PORT")
    if raw is None:
        from router.settings import RouterSettings

        return RouterSettings().port
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"KVROUTE_PORT={raw!r} is not a port") from None
    if not 0 <= port < 65536:
        raise ValueError(f"KVROUTE_PORT={raw!r} is not in 0..65535")
    return port


def run_up(args: argparse.Namespace) -> int:
    """Run the cluster until Ctrl-C or SIGTERM."""
    logs = ["--log-format", args.log_format] if args.log_format else []
    try:
        cluster = Cluster(args.workers, router_port(args.port),
                          worker_args=[*logs, *(args.worker_arg or [])],
                          router_args=[*logs, *(args.router_arg or [])], log_dir=args.log_dir,
                          worker_ports=args.worker_ports)
    except ValueError as exc:
        print(f"kvroute up: {exc}", file=sys.stderr)
        return 2
    stopping = starting = False

    def on_signal(signum: int, _: object) -> None:
        nonlocal stopping
        stopping = True
        if starting:  # stop waiting for readiness at once
            raise _Interrupted

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    schedule = RestartSchedule()
    due: dict[str, float] = {}
    try:
        starting = True
        cluster.start(timeout=args.timeout)
        starting = False
        print(f"kvroute is up: {cluster.url} (router + {args.workers} sim workers)")
        print(f"try:\n  {_example(cluster.url)}", flush=True)
        last = 0.0
        while not stopping:
            now = time.monotonic()
            for child in list(cluster.children):
                if child.name in due or child.process.poll() is None:
                    if due.get(child.name, now + 1) <= now:
                        del due[child.name]
                        cluster.restart(child)
                    continue
                code = child.process.returncode
                if child.name == "router":
                    print(f"kvroute up: the router exited with {code}", file=sys.stderr)
                    return 1
                at = schedule.exited(child.name, now)
                if at is None:
                    print(f"kvroute up: {child.name} exited with {code} after "
                          f"{schedule.limit} restarts; left down (the router routes around "
                          "it)", file=sys.stderr, flush=True)
                    cluster.children.remove(child)
                    continue
                print(f"kvroute up: {child.name} exited with {code}; restarting it in "
                      f"{at - now:.0f}s (restart {schedule.restarts(child.name)} of "
                      f"{schedule.limit})", file=sys.stderr, flush=True)
                due[child.name] = at
            if time.monotonic() - last >= args.status_interval:
                print(f"[{time.strftime('%H:%M:%S')}] {cluster.status()}", flush=True)
                last = time.monotonic()
            time.sleep(0.2)
        return 0
    except _Interrupted:
        return 130
    except RuntimeError as exc:
        print(f"kvroute up: {exc}", file=sys.stderr)
        return 1
    finally:
        starting = False
        print("stopping...", file=sys.stderr)
        cluster.stop()
