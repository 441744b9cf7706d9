"""Real router and worker processes on 127.0.0.1 for end-to-end tests.

Each process is ``python -m kvroute.cli ...`` with free ports, configured through the same
environment variables the compose file uses (``KVROUTE_WORKERS`` for the router,
``KVROUTE_WORKER_*`` for workers), its output in a log file the test prints on failure. Waits
are bounded and poll a condition (a process cannot be awaited across a socket any other way)
through :func:`tests.support.eventually.eventually_blocking`; nothing sleeps a fixed time to
synchronise.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from indexer.decode import decode_batch
from kvroute.up import free_port
from router.fleet.engines.prometheus import parse_metrics
from tests.support.eventually import eventually_blocking

#: What a probe of a process that is still starting (or restarting) may raise: "not yet".
NOT_YET = (httpx.HTTPError, KeyError, ValueError)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the ``name`` samples in the Prometheus text ``text`` whose labels include
    ``labels`` (0 when there is none)."""
    return sum(s.value for s in parse_metrics(text).named(name)
               if all(s.labels.get(k) == v for k, v in labels.items()))


def ranks_served(first: int, answer: Callable[[int], httpx.Response], tries: int = 40
                 ) -> set[int]:
    """The data-parallel ranks (of two) that served: ``first``, then each ``answer(i)``'s
    for i = 0, 1, ... until both have. Prompts that share nothing find both ranks idle, a tie
    broken at random, so ``tries`` of them miss a rank with a chance of 2**-(tries - 1)."""
    seen = {first}
    for i in range(tries):
        if seen == {0, 1}:
            break
        served = answer(i)
        assert served.status_code == 200, served.text
        seen.add(int(served.headers["x-kvroute-worker-rank"]))
    return seen


class Process:
    """One kvroute child process with its log."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.log = log_dir / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """What runs: ``kvroute`` with :attr:`args`."""
        return [sys.executable, "-m", "kvroute.cli", *self.args]

    def start(self) -> None:
        out = self.log.open("ab")
        self.popen = subprocess.Popen(self.command(),
                                      env={**os.environ, **self.env}, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process group and reap it."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Worker(Process):
    """A sim worker: HTTP, event and replay ports fixed for its whole life (restarts too)."""

    def __init__(self, index: int, log_dir: Path, **settings: Any) -> None:
        self.port = free_port()
        env = {"KVROUTE_WORKER_PORT": str(self.port),
               "KVROUTE_WORKER_EVENTS_PORT": str(free_port()),
               "KVROUTE_WORKER_REPLAY_PORT": str(free_port())}
        env |= {f"KVROUTE_WORKER_{k.upper()}": str(v) for k, v in settings.items()}
        super().__init__(f"worker-{index}", ["worker"], env, log_dir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 30.0) -> None:
        def healthy() -> bool:
            return self.alive() and httpx.get(f"{self.url}/health").status_code == 200
        eventually_blocking(healthy, f"{self.name} healthy", timeout, tolerate=NOT_YET)

    def resident(self) -> dict[int, int]:
        """Engine hash -> tier bits (1 device, 2 host) of what the worker holds, from its
        snapshot (the blocks its event stream has told consumers about)."""
        snap = httpx.get(f"{self.url}/kv/snapshot", timeout=10).json()
        held: dict[int, int] = {}
        for event in decode_batch(base64.b64decode(snap["payload_b64"])).events:
            bit = 2 if getattr(event, "medium", None) == "CPU" else 1
            for h in event.block_hashes:
                held[h] = held.get(h, 0) | bit
        return held


class Router(Process):
    """A router in front of the given workers."""

    def __init__(self, name: str, workers: list[Worker], log_dir: Path, *,
                 specs: list[str] | None = None, **settings: Any) -> None:
        # ``specs``: the workers in their flat text form (URL,role=...), instead of URLs.
        self.port = free_port()
        env = {"KVROUTE_PORT": str(self.port),
               "KVROUTE_WORKERS": ",".join(specs or [w.url for w in workers]),
               "KVROUTE_HEALTH_INTERVAL": "0.2", "KVROUTE_UNHEALTHY_GRACE": "1.0"}
        env |= {f"KVROUTE_{k.upper()}": str(v) for k, v in settings.items()}
        super().__init__(name, ["router"], env, log_dir)
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def start(self) -> None:
        if self.client.is_closed:
            self.client = httpx.Client(base_url=self.url, timeout=30)
        super().start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, workers: int, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"{self.name} exited:\n{self.tail()}")
            r = self.client.get("/ready")
            return r.status_code == 200 and r.json()["workers"] == workers
        eventually_blocking(ready, f"{self.name} ready with {workers} workers", timeout,
                            tolerate=NOT_YET)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        super().kill(sig)
        self.client.close()

    def workers(self) -> list[dict[str, Any]]:
        return self.client.get("/workers").json()["workers"]  # type: ignore[no-any-return]

    def entry(self, url: str) -> dict[str, Any]:
        """The router's ``/workers`` entry of the worker at ``url``."""
        return next(w for w in self.workers() if w["url"] == url)

    def worker_id(self, worker: Worker) -> int:
        return int(self.entry(worker.url)["id"])

    def indexed(self, worker: Worker) -> dict[int, int]:
        """Engine hash -> tier bits the router's index holds for ``worker``."""
        body = self.client.get(f"/debug/index/{self.worker_id(worker)}").json()
        return {int(h): t for h, t in body["blocks"].items()}

    def complete(self, prompt: str | list[int], max_tokens: int = 4, **extra: Any
                 ) -> httpx.Response:
        body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": max_tokens, **extra}
        return self.client.post("/v1/completions", json=body)


@contextlib.contextmanager
def router_over(router: Router, servers: Sequence[Any], ready: int) -> Iterator[Router]:
    """Start ``router`` in front of ``servers``, already running (they are not stopped here),
    and wait until it has ``ready`` workers; yields it, and kills it at the end. When the
    block raised, every log (the servers', the router's) is printed first."""
    try:
        router.start()
        router.wait_ready(ready)
        yield router
    except BaseException:
        for p in [*servers, router]:
            print(f"---- {p.name} ----\n{p.tail()}")
        raise
    finally:
        router.kill()


@contextlib.contextmanager
def running(servers: Sequence[Any]) -> Iterator[list[Any]]:
    """Start ``servers`` (processes with ``start``, ``wait_healthy``, ``kill``, ``tail`` and a
    ``name``, such as :class:`Worker` or a vLLM server) and wait until each is healthy; yields
    the list of processes to tear down, to which the caller appends the router it starts.
    At the end every one is killed; when the block raised, their logs are printed first."""
    started = list(servers)
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_healthy()
        yield started
    except BaseException:
        for p in started:
            print(f"---- {p.name} ----\n{p.tail()}")
        raise
    finally:
        for p in reversed(started):
            p.kill()
