"""Engine adapters: how the router learns who a worker is, and how loaded, per engine.

``kvroute`` (the bundled worker, the default) describes itself at ``/model_info`` and reports
load at ``/load``; ``vllm``, ``sglang`` and ``trtllm`` are stock servers read through
``/v1/models``, ``/health`` and their Prometheus metrics (:mod:`router.fleet.engines.stock`).
"""

from __future__ import annotations

from router.fleet.engines.base import (
    EngineAdapter,
    PollFailed,
    WorkerChanged,
    WorkerUnreachable,
)
from router.fleet.engines.kvroute import KvrouteEngine
from router.fleet.engines.stock import SGLANG, TRTLLM, VLLM, StockEngine

__all__ = ["EngineAdapter", "PollFailed", "WorkerChanged", "WorkerUnreachable", "adapter_for"]

_ADAPTERS: dict[str, EngineAdapter] = {
    "kvroute": KvrouteEngine(),
    "vllm": StockEngine("vllm", VLLM),
    "sglang": StockEngine("sglang", SGLANG),
    "trtllm": StockEngine("trtllm", TRTLLM),
}


def adapter_for(engine: str) -> EngineAdapter:
    """The adapter for ``engine`` (one of :data:`router.fleet.worker_config.ENGINES`).

    Raises:
        ValueError: no such engine.
    """
    try:
        return _ADAPTERS[engine]
    except KeyError:
        raise ValueError(f"no adapter for engine {engine!r}") from None
