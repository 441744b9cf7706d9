"""A worker removed while its health check is in flight stays removed: the check subscribes to
nothing afterwards (a real registry against a real HTTP worker on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import httpx

from indexer.index import PrefixIndex
from kvroute.up import free_port
from router.fleet.facts import FleetFacts
from router.fleet.registry import Registry
from router.fleet.worker_table import WorkerState
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker


async def test_a_worker_removed_mid_reconnect_is_not_subscribed_again() -> None:
    settings = RouterSettings(unhealthy_grace=0.0)
    async with ScriptedWorker() as worker, httpx.AsyncClient() as http:
        worker.model_info_extra = {"events_endpoint": f"tcp://127.0.0.1:{free_port()}"}
        reg = Registry(settings.fleet_settings(), PrefixIndex(settings.block_size),
                       FleetFacts(), "bytes-v1", http)
        try:
            entry = await reg.add(worker.url)
            assert entry.feed is not None, "a worker with an event endpoint is subscribed"
            worker.load_answer = b"not json"
            await reg.poll_once()  # unhealthy, and with no grace its subscription stops
            assert entry.state is WorkerState.UNHEALTHY and entry.feed is None
            # it answers again: the next check reads /model_info to reconnect, which hangs
            worker.load_answer = b'{"running": 0}'
            worker.hang_model_info()
            calls = worker.model_info_calls
            check = asyncio.create_task(reg.poll_once())
            await eventually(lambda: worker.model_info_calls > calls,
                             "the check to ask /model_info")
            await reg.remove(entry.id)  # as DNS discovery or DELETE /workers/{id} would
            worker.resume()
            await asyncio.wait_for(check, 10)
            assert reg.get(entry.id) is None
            assert entry.feed is None, "the removed worker was subscribed to again"
            assert entry.state is not WorkerState.HEALTHY
        finally:
            await reg.stop()
