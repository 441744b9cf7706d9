"""The bundled kvroute worker: it describes itself at ``GET /model_info`` (block size,
tokenizer identity, instance id, event endpoints, snapshot support) and reports its load at
``GET /load`` in the router's own terms."""

from __future__ import annotations

import httpx

from router.fleet.engines.base import (
    AnswerTooLarge,
    PollFailed,
    WorkerUnreachable,
    poll_failed,
    read_answer,
)
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
        url = f"{worker.url}/model_info"
        try:
            answer = await read_answer(http, url, timeout=5.0)
            answer.raise_for_status(url)
            return parse_model_info(worker.url, answer.content)
        except AnswerTooLarge as exc:
            raise WorkerUnreachable(str(exc), oversize=True) from None
        except (httpx.HTTPError, MalformedAnswer) as exc:
            raise WorkerUnreachable(f"{worker.url}/model_info: {type(exc).__name__}: {exc}"
                                    ) from exc

    async def poll(self, http: httpx.AsyncClient, worker: WorkerConfig,
                   info: WorkerInfo | None, timeout: float = 2.0) -> ReportedLoad:
        """Read ``GET /load`` (see :class:`~router.fleet.engines.base.EngineAdapter`)."""
        url = f"{worker.url}/load"
        try:
            answer = await read_answer(http, url, timeout=timeout)
            answer.raise_for_status(url)
            return parse_load(answer.content, info.block_size if info else 1)
        except AnswerTooLarge as exc:
            raise PollFailed(f"load poll failed: {exc}", oversize=True) from None
        except httpx.HTTPError as exc:
            raise poll_failed("load poll", exc, timeout) from exc
        except MalformedAnswer as exc:
            raise PollFailed(f"load poll failed: {type(exc).__name__}: {exc}") from exc
