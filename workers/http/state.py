"""The worker app's state: one typed object holding what every handler reads.

The runtime (engine, tokenizer, event publisher) is built with the app, so a bad setting fails
before the server starts; the lifespan starts it and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from httpapi.app import Admin
from httpapi.responses import disconnect_counter
from httpapi.tracing import Tracing
from openai_request.bodies import ApiError
from workers.http.image_fetch import ImageBudget
from workers.http.kv_fetch import PeerFetcher
from workers.http.kv_ipc import HolderIpc, IpcBackend, IpcPeers
from workers.http.kv_pull import engine_kv
from workers.http.kv_read import BlockReads
from workers.http.kv_transfer import HeldPrefills
from workers.http.metrics import WorkerMetrics
from workers.http.tracing import worker_tracing
from workers.http.transfer_auth import TransferAuth
from workers.runtime import WorkerRuntime
from workers.settings import WorkerSettings

__all__ = ["WorkerState"]

log = logging.getLogger(__name__)


class WorkerState:
    """The worker's parts, for its handlers (:class:`httpapi.app.AppState`)."""

    #: The span exporter while the lifespan runs, when tracing is on (workers.http.tracing).
    tracing: Tracing | None = None

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.admin = Admin(settings.admin_token)
        self.runtime = WorkerRuntime(settings)
        self.metrics = WorkerMetrics(self.runtime)
        self.disconnects = disconnect_counter(self.metrics.registry)
        #: Image bytes being fetched for all requests (``max_image_fetch_bytes``).
        self.image_budget = ImageBudget(settings.max_image_fetch_bytes)
        #: Disaggregated serving: prefills held for their decode workers, and the client
        #: that tells a prefill worker its KV was taken.
        self.held_prefills = HeldPrefills(settings.kv_lease_seconds / settings.speedup)
        self.peers = httpx.AsyncClient(timeout=5.0)
        #: Peer KV fetch: who may read this worker's KV and instruct it, the reads it
        #: serves, and the fetches it runs (docs/kv_transfer.md).
        self.transfer_auth = TransferAuth(settings.kv_transfer_secret, settings.host)
        kv = engine_kv(self.runtime.engine)
        cuda = _cuda_ipc(kv) if settings.kv_fetch_ipc else None
        # The pool's handle reads and writes every block of every tenant (the byte path
        # answers only keys the reader could name): only peers holding the secret get it.
        backend = cuda if settings.kv_transfer_secret is not None else None
        #: Why peer fetch over CUDA IPC is off where it could run (logged at start).
        self.ipc_off_reason = None if cuda is None or backend is not None else (
            "it hands a peer this worker's whole KV pool (every tenant's blocks, to read and "
            "write), so it needs the shared --kv-transfer-secret-file; peers read blocks over "
            "HTTP")
        holder = HolderIpc(backend, None if kv is None else kv.layout(),
                           0 if kv is None else kv.num_blocks + 1)
        self.block_reads = BlockReads(self.runtime.engines, settings.kv_read_concurrency,
                                      ipc=holder)
        self.fetcher = PeerFetcher(settings, httpx.AsyncClient(timeout=settings.kv_fetch_timeout),
                                   ipc=IpcPeers(backend))

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """Start the engine and the event publisher; stop them at the end."""
        await self.runtime.start()
        if self.settings.tracing:
            self.tracing = worker_tracing()
        if not self.transfer_auth.enabled:
            log.warning("peer KV fetch is off: %s", self.transfer_auth.off_reason)
        elif self.ipc_off_reason is not None:
            log.info("peer KV fetch over CUDA IPC is off: %s", self.ipc_off_reason)
        try:
            yield
        finally:
            if self.tracing is not None:  # its last export may wait on the collector
                await asyncio.to_thread(self.tracing.shutdown)
            await self.fetcher.http.aclose()
            await self.peers.aclose()
            await self.runtime.stop()

    def refused(self, error: ApiError) -> None:
        """Count a refused request by its status."""
        self.metrics.refused.labels(str(error.status)).inc()

    def client_gone(self, stage: str) -> None:
        """Count a client that left before its answer."""
        self.disconnects.labels(stage).inc()

    def render_metrics(self) -> tuple[bytes, str]:
        """The worker's Prometheus exposition."""
        return generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST


def _cuda_ipc(kv: object) -> IpcBackend | None:
    """The torch engine's CUDA IPC backend when its KV is on CUDA (torch is imported only
    for a torch engine's KV)."""
    if kv is None:
        return None
    from workers.torch.kv_ipc import cuda_ipc_for

    return cuda_ipc_for(kv)
