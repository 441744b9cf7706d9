"""The bundled kvroute worker: it describes itself at ``GET /model_info`` (block size,
tokenizer identity, instance id, event endpoints, snapshot support) and reports its load at
``GET /load`` in the router's own terms."""

from __future__ import annotations

from typing import Any

import httpx

from router.engines.base import PollFailed, WorkerUnreachable
from router.load import ReportedLoad
from router.worker_config import WorkerConfig
from router.worker_table import WorkerInfo, parse_model_info

__all__ = ["KvrouteEngine"]


class KvrouteEngine:
    """Adapter for kvroute's own worker (``workers/``)."""

    name = "kvroute"

    async def describe(self, http: httpx.AsyncClient, worker: WorkerConfig,
                       router_block_size: int) -> WorkerInfo:
        """Read ``GET /model_info`` (see :class:`~router.engines.base.EngineAdapter`)."""
        try:
            response = await http.get(f"{worker.url}/model_info", timeout=5.0)
            response.raise_for_status()
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise WorkerUnreachable(f"{worker.url}/model_info: {type(exc).__name__}: {exc}"
                                    ) from exc
        return parse_model_info(worker.url, body)

    async def poll(self, http: httpx.AsyncClient, worker: WorkerConfig,
                   info: WorkerInfo | None) -> ReportedLoad:
        """Read ``GET /load`` (see :class:`~router.engines.base.EngineAdapter`)."""
        try:
            response = await http.get(f"{worker.url}/load", timeout=2.0)
            response.raise_for_status()
            load = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PollFailed(f"load poll failed: {type(exc).__name__}: {exc}") from exc
        return _reported(load, info.block_size if info else 1)


def _reported(load: Any, block_size: int) -> ReportedLoad:
    if type(load) is not dict:
        return ReportedLoad()

    def num(name: str) -> float:
        value = load.get(name, 0)
        return float(value) if isinstance(value, int | float) else 0.0

    return ReportedLoad(running=int(num("running")), waiting=int(num("waiting")),
                        pending_prefill_blocks=num("pending_prefill_tokens") / block_size,
                        decode_blocks=num("decode_blocks"))
