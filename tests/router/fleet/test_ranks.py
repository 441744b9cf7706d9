"""Data-parallel ranks in the registry: each rank a candidate with an id and books of its own,
shaped from the engine's report or the configured ``dp_size``, gone with the worker (a real
registry against a real HTTP worker on 127.0.0.1)."""

from __future__ import annotations

import httpx

from indexer.events import Stored
from indexer.index import PrefixIndex
from router.fleet.facts import FleetFacts
from router.fleet.ranks import WorkerRank, rank_endpoint
from router.fleet.registry import Registry
from router.fleet.worker_config import WorkerConfig
from router.fleet.worker_table import WorkerInfo
from router.settings import RouterSettings
from tests.support.servers import ScriptedWorker


class _Told(FleetFacts):
    """The workers the registry said joined and left."""

    def __init__(self) -> None:
        self.members: set[int] = set()
        self.left_ids: list[int] = []

    def joined(self, worker: int, engine: str, info: WorkerInfo | None) -> None:
        self.members.add(worker)

    def left(self, worker: int) -> None:
        self.members.discard(worker)
        self.left_ids.append(worker)


def _registry(http: httpx.AsyncClient) -> tuple[Registry, PrefixIndex, _Told]:
    settings = RouterSettings()
    index, told = PrefixIndex(settings.block_size), _Told()
    return Registry(settings.fleet_settings(), index, told, "bytes-v1", http), index, told


async def test_a_worker_reporting_two_ranks_is_two_candidates() -> None:
    async with ScriptedWorker() as worker, ScriptedWorker() as plain, \
            httpx.AsyncClient() as http:
        worker.model_info_extra = {"data_parallel_size": 2}
        reg, index, told = _registry(http)
        try:
            entry = await reg.add(worker.url)
            other = await reg.add(plain.url)
            (rank1,) = entry.extra_ranks
            assert isinstance(rank1, WorkerRank)
            # The worker is rank 0 under its own id; rank 1 takes the next id, the next
            # worker the one after.
            assert (entry.id, rank1.id, other.id) == (0, 1, 2)
            assert [(t.id, t.rank) for t in reg.candidates()] == [(0, 0), (1, 1), (2, None)]
            assert reg.healthy() == [entry, other]
            assert reg.target(1) is rank1 and reg.get(1) is None
            assert rank1.url == entry.url and rank1.state is entry.state
            assert told.members == {0, 1, 2}
            described = entry.describe()
            assert (described["dp_size"], described["ranks"]) == (
                2, [{"rank": 0, "id": 0}, {"rank": 1, "id": 1}])
            assert other.describe()["ranks"] == []

            block = Stored(block_hashes=[5], parent_block_hash=None,
                           token_ids=list(range(32)), block_size=32)
            index.apply_batch(1, [block])
            await reg.remove(entry.id)
            # Every rank leaves the index, the books and the candidates with the worker.
            assert index.worker_blocks(1) == (0, 0)
            assert reg.target(1) is None
            assert told.members == {2} and sorted(told.left_ids) == [0, 1]
            assert [t.id for t in reg.candidates()] == [2]
        finally:
            await reg.stop()


async def test_a_configured_dp_size_wins_over_the_engines_report() -> None:
    async with ScriptedWorker() as worker, httpx.AsyncClient() as http:
        worker.model_info_extra = {"data_parallel_size": 2}
        reg, _, _ = _registry(http)
        try:
            entry = await reg.add(WorkerConfig(worker.url, dp_size=3))
            assert [t.rank for t in entry.targets] == [0, 1, 2]
            assert len(reg.candidates()) == 3
        finally:
            await reg.stop()


def test_a_ranks_own_stream_is_where_vllm_puts_it() -> None:
    assert rank_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert rank_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert rank_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert rank_endpoint("tcp://*:0", 2) == "tcp://*:0"  # any free port: left to the OS
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
