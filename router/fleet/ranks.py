"""Data-parallel ranks: several engines, each with a cache of its own, behind one worker URL.

``vllm serve --data-parallel-size N``, SGLang's DP attention and ``kvroute worker
--data-parallel-size N`` serve N engines behind one HTTP port. Their caches are disjoint, so
the router treats each rank as a candidate of its own: an id in the prefix index, the load
books and the routing core, exactly like a worker's. The mapping between the two lives here,
in the fleet room; nothing below it knows a rank from a worker.

- Rank 0 is the worker's :class:`~router.fleet.entry.WorkerEntry` itself (its id is the
  worker id), so a worker with one rank is what it always was.
- Ranks 1..N-1 are :class:`WorkerRank` views with ids of their own, taken from the registry's
  id sequence; everything but the id and the rank (URL, health, model info, liveness) is the
  worker's.
- kvroute's worker publishes every rank's batches on one stream: its feed routes each batch
  to its rank's id by the batch's ``data_parallel_rank`` (:mod:`router.events.feed`). vLLM
  publishes rank r on the configured port + r (:func:`rank_endpoint`): a stock worker gets one
  feed per rank, each applying to its rank's id.
- The proxy pins the chosen rank with the ``X-data-parallel-rank`` header, which vLLM and
  SGLang honour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.fleet.engines import EngineAdapter
    from router.fleet.entry import WorkerEntry
    from router.fleet.first_byte_waits import FirstByteWaits
    from router.fleet.liveness import Liveness
    from router.fleet.worker_table import WorkerInfo, WorkerState

__all__ = ["RANK_HEADER", "WorkerRank", "rank_endpoint"]

#: The request header vLLM and SGLang read to pin a request to one data-parallel rank.
RANK_HEADER = "x-data-parallel-rank"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where rank ``rank`` of an engine that publishes one stream per rank (vLLM) publishes,
    given rank 0's endpoint: a TCP port shifted by the rank, as vLLM shifts it (port 0, any
    free port, stays 0; another transport gets vLLM's ``_dp{rank}`` suffix)."""
    if rank == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + rank}" if int(port) else endpoint
    return f"{endpoint}_dp{rank}"


class WorkerRank:
    """Rank ``rank`` (1 or more) of ``worker``, a routing candidate with id ``id``.

    Reads through to the worker for everything it shares with its other ranks, so a change of
    the worker's health or model info is every rank's at once.
    """

    __slots__ = ("id", "rank", "worker")

    def __init__(self, id: int, rank: int, worker: WorkerEntry) -> None:
        assert rank >= 1, "rank 0 is the worker entry itself"
        self.id = id
        self.rank: int | None = rank
        self.worker = worker

    @property
    def url(self) -> str:
        """The worker's URL (every rank answers there)."""
        return self.worker.url

    @property
    def state(self) -> WorkerState:
        """The worker's health."""
        return self.worker.state

    @property
    def info(self) -> WorkerInfo | None:
        """The worker's model info."""
        return self.worker.info

    @property
    def approximate(self) -> bool:
        """Whether the worker publishes no events."""
        return self.worker.approximate

    @property
    def waits(self) -> FirstByteWaits:
        """The worker's requests waiting for a first byte (given up together)."""
        return self.worker.waits

    @property
    def liveness(self) -> Liveness:
        """The worker's evidence of life."""
        return self.worker.liveness

    @property
    def counters(self) -> dict[str, float]:
        """The worker's counters."""
        return self.worker.counters

    @property
    def role(self) -> str:
        """The worker's role."""
        return self.worker.role

    @property
    def adapter(self) -> EngineAdapter:
        """The worker's engine adapter."""
        return self.worker.adapter

    def describe(self) -> dict[str, Any]:
        """This rank in ``GET /workers``."""
        return {"rank": self.rank, "id": self.id}

    def __repr__(self) -> str:
        return f"WorkerRank(id={self.id}, rank={self.rank}, url={self.url!r})"
