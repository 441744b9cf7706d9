"""End-to-end fixtures: real workers and routers as processes, torn down even on failure."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.tiny_model import write_tiny_llama
from e2e.harness import Process, Router, Worker, running
from e2e.vllm import VllmPair, vllm_python, vllm_server


@pytest.fixture
def processes(request: pytest.FixtureRequest) -> Iterator[list[Process]]:
    """The processes a test starts (it appends them): every one is killed at the end, and
    their logs are printed when the test failed."""
    started: list[Process] = []
    yield started
    for p in reversed(started):
        p.kill()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for p in started:
            print(f"---- {p.name} ----\n{p.tail()}")


@pytest.fixture
def cluster(tmp_path: Path, processes: list[Process]) -> Callable[..., Any]:
    """Factory: ``cluster(workers=3, worker_settings={...}, router_settings={...})`` starts
    the workers and one router, waits until ready, and returns ``(router, workers)``. Every
    process started is killed at the end; their logs are printed when the test failed."""

    def make(workers: int = 3, worker_settings: dict[str, Any] | None = None,
             router_settings: dict[str, Any] | None = None) -> tuple[Router, list[Worker]]:
        ws = [Worker(i, tmp_path, **(worker_settings or {})) for i in range(workers)]
        for w in ws:
            w.start()
            processes.append(w)
        for w in ws:
            w.wait_healthy()
        router = Router("router", ws, tmp_path, **(router_settings or {}))
        router.start()
        processes.append(router)
        router.wait_ready(workers)
        return router, ws

    return make


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPair]:
    """Two plain stock vLLM servers, started once for the modules that share them (they run
    on one pytest-xdist runner: the top-level ``conftest.py`` puts them in one group). Take it
    through :meth:`VllmPair.fresh`."""
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm-pair")
    model = write_tiny_llama(root / "model")
    servers = [vllm_server(f"vllm-{i}", python, model, root) for i in range(2)]
    with running(servers):
        yield VllmPair(servers, model, root)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
