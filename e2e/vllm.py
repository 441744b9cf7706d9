"""Stock vLLM servers for the end-to-end tests: where vLLM's interpreter is, how a test's
server runs, and the pair of plain servers that the modules which can share one use (each
module starts its own router in front of it).

A vLLM server takes tens of seconds of CPU to start on two cores, nearly all of it importing
torch and vLLM once per process, so the pair starts once for the run (the ``vllm_pair`` fixture
of ``e2e/conftest.py``); each module that takes it finds both servers healthy and their prefix
caches empty. A module that needs other flags (data parallelism, a KV connector) starts servers
of its own.

Every server here runs its model in its engine core's process
(:data:`bench.stock_vllm.ONE_PROCESS_ENGINE`): vLLM's CPU build otherwise starts a worker
process beside each engine core only to bind OpenMP threads, which these servers leave
unbound. One torch-and-vLLM import fewer per engine: a plain server's start 28.8 to 18.2 CPU
seconds (45.2 to 25.3 in a busier sitting), a two-rank data-parallel one's 46.8 to 32.7
(``python -m bench.vllm_start``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.stock_vllm import MODEL_NAME, ONE_PROCESS_ENGINE, VllmServer, find_vllm_python
from e2e.harness import NOT_YET
from tests.support.eventually import eventually_blocking


def vllm_python() -> Path:
    """vLLM's interpreter; where it is missing the tests skip, except under CI, where they
    fail: a missing engine must not pass as green."""
    try:
        return find_vllm_python()
    except FileNotFoundError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


def vllm_server(name: str, python: Path, model: Path, log_dir: Path,
                extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None
                ) -> VllmServer:
    """A test's vLLM server: :class:`VllmServer` with ``ONE_PROCESS_ENGINE`` under
    ``extra_env``."""
    return VllmServer(name, python, model, log_dir, extra_args,
                      {**ONE_PROCESS_ENGINE, **(extra_env or {})})


@dataclass
class VllmPair:
    """Two plain vLLM servers of the tiny model, their model folder and their log folder."""

    servers: list[VllmServer]
    model: Path
    root: Path

    def fresh(self) -> VllmPair:
        """The pair as a new module takes it: each server healthy (restarted if a module
        killed it), its prefix cache emptied and the clear published on its event stream, so
        a router started now learns none of an earlier module's blocks."""
        for server in self.servers:
            if not server.alive():
                server.start()
            server.wait_healthy()
            # The reset fails while blocks are held: a stream an earlier module left may run
            # on until vLLM notices its client gone.
            eventually_blocking(server.reset_prefix_cache, f"{server.name}'s prefix cache reset",
                                120, tolerate=NOT_YET)
            # vLLM publishes the clear with its next engine step: give it one, too short to
            # store a block of its own.
            httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}).raise_for_status()
        return self

