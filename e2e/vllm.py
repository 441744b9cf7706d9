"""Stock vLLM servers for the end-to-end tests: where vLLM's interpreter is, and the pair of
plain servers that the modules which can share one use (each module starts its own router in
front of it).

A vLLM server takes tens of seconds to start on two cores, so the pair starts once for the
run (the ``vllm_pair`` fixture of ``e2e/conftest.py``); each module that takes it finds both
servers healthy and their prefix caches empty. A module that needs other flags (data
parallelism, a KV connector) starts servers of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.stock_vllm import VllmServer, find_vllm_python


def vllm_python() -> Path:
    """vLLM's interpreter; where it is missing the tests skip, except under CI, where they
    fail: a missing engine must not pass as green."""
    try:
        return find_vllm_python()
    except FileNotFoundError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


@dataclass
class VllmPair:
    """Two plain vLLM servers of the tiny model, their model folder and their log folder."""

    servers: list[VllmServer]
    model: Path
    root: Path

    def fresh(self) -> VllmPair:
        """The pair as a new module takes it: each server healthy (restarted if a module
        killed it) and its prefix cache emptied."""
        for server in self.servers:
            if not server.alive():
                server.start()
            server.wait_healthy()
            server.reset_prefix_cache()
        return self
