"""The bundled kvroute worker: it describes itself at ``GET /model_info`` (block size,
tokenizer identity, instance id, event endpoints, snapshot support) and reports its load at
``GET /load`` in the router's own terms."""

from __future__ import annotations

import httpx

from router.fleet.engines.base import PollFailed, WorkerUnreachable, poll_failed
from router.fleet.worker_answers import MalformedAnswer, parse_load, parse_model_info
from router.fleet.worker_config import WorkerConfig
from router.fleet.worker_table import WorkerInfo
from router.routing.load import ReportedLoad

__all__ = ["KvrouteEngine"]


class KvrouteEngine:
    """Adapter for kvroute's own worker (``workers/``); its answers are parsed by
    :mod:`router.fleet.worker_answers`."""

    name = "kvroute"

    async def describe(self, http: httpx.AsyncClient, worker: WorkerConfig,
                       router_block_size: int) -> WorkerInfo:
        """Read ``GET /model_info`` (see :class:`~router.fleet.engines.base.EngineAdapter`)."""
        try:
            response = await http.get(f"{worker.url}/model_info", timeout=5.0)
            response.raise_for_status()
            return parse_model_info(worker.url, response.content)
        except (httpx.HTTPError, MalformedAnswer) as exc:
            raise WorkerUnreachable(f"{worker.url}/model_info: {type(exc).__name__}: {exc}"
                                    ) from exc

    async def poll(self, http: httpx.AsyncClient, worker: WorkerConfig,
                   info: WorkerInfo | None, timeout: float = 2.0) -> ReportedLoad:
        """Read ``GET /load`` (see :class:`~router.fleet.engines.base.EngineAdapter`)."""
        try:
            response = await http.get(f"{worker.url}/load", timeout=timeout)
            response.raise_for_status()
            return parse_load(response.content, info.block_size if info else 1)
        except httpx.HTTPError as exc:
            raise poll_failed("load poll", exc, timeout) from exc
        except MalformedAnswer as exc:
            raise PollFailed(f"load poll failed: {type(exc).__name__}: {exc}") from exc
