"""The router app's state: one typed object holding what every handler reads.

The settings are given when the app is built; the parts that need an event loop or load a
tokenizer (the service with its registry, the proxy's connection pool, the metrics, the
first-byte clock, flow control's queue) are made when the lifespan starts and closed when it
ends, so building an
app costs nothing and a bad tokenizer path fails at start-up, where the server reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from prometheus_client import Counter

from httpapi.app import Admin
from httpapi.responses import DISCONNECT_STAGES, disconnect_counter
from httpapi.tracing import Tracing
from httpapi.trusted_peers import TrustedPeers
from openai_request.bodies import ApiError
from router.http.client_quotas import ClientAccess
from router.http.first_byte import FirstByteClock
from router.http.flow import FlowControl
from router.http.flow_metrics import register_flow_metrics
from router.http.metrics import RouterMetrics
from router.http.proxy import Proxy, ProxyTimeouts
from router.http.tracing import router_tracing
from router.service import RouterService
from router.settings import RouterSettings

__all__ = ["RouterState"]


class RouterState:
    """The router's parts, for its handlers (:class:`httpapi.app.AppState`).

    Invariants:
        1. ``settings``, ``admin`` and ``trusted_clients`` exist from construction; the
           other attributes exist once :meth:`lifespan` has started and stay until the
           object is dropped (a stream still relaying while the server stops may read them).
    """

    #: The event loop the lifespan (and so every request) runs on.
    loop: asyncio.AbstractEventLoop
    service: RouterService
    proxy: Proxy
    metrics: RouterMetrics
    first_byte: FirstByteClock
    flow: FlowControl
    disconnects: Counter
    #: Client API keys and their quotas; None: ``/v1/*`` is open.
    access: ClientAccess | None = None
    #: The span exporter, when tracing is on (router.http.tracing).
    tracing: Tracing | None = None

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.admin = Admin(settings.admin_token)
        #: The peers whose flow-control headers are believed (router.http.client_trust).
        self.trusted_clients = TrustedPeers.parse(settings.trusted_clients)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """Make the parts, start the fleet's registry; stop and close them at the end."""
        settings = self.settings
        self.loop = asyncio.get_running_loop()
        http = httpx.AsyncClient()
        self.service = RouterService(settings, http)
        self.proxy = Proxy(ProxyTimeouts(connect=settings.connect_timeout,
                                         first_byte=settings.first_byte_timeout))
        await self.proxy.start()
        self.metrics = RouterMetrics(self.service)
        self.first_byte = FirstByteClock(settings.first_byte_floor, settings.first_byte_factor,
                                         settings.first_byte_timeout)
        self.disconnects = disconnect_counter(self.metrics.registry, DISCONNECT_STAGES)
        self.flow = FlowControl(settings.flow_settings(), self.service.decide_again)
        self.service.capacity = self.flow
        register_flow_metrics(self.metrics.registry, self.flow, self.metrics.worker_label)
        ring = settings.client_key_ring()
        if ring is not None:
            self.access = ClientAccess(ring, settings.api_key_tokens_per_minute,
                                       self.metrics.registry)
        if settings.tracing:
            self.tracing = router_tracing()
        await self.service.start()
        try:
            yield
        finally:
            if self.tracing is not None:  # its last export may wait on the collector
                await asyncio.to_thread(self.tracing.shutdown)
            await self.flow.close()
            await self.service.stop()
            await self.proxy.close()
            await http.aclose()

    def refused(self, error: ApiError) -> None:
        """Refusals are counted where they happen, by endpoint (:meth:`RouterMetrics.request`)."""

    def client_gone(self, stage: str) -> None:
        """Count a client that left before its answer, at ``stage`` (of
        :data:`~httpapi.responses.DISCONNECT_STAGES`: the label set stays the code's)."""
        assert stage in DISCONNECT_STAGES, f"an unknown disconnect stage {stage!r}"
        self.disconnects.labels(stage).inc()

    def render_metrics(self) -> tuple[bytes, str]:
        """The router's Prometheus exposition."""
        return self.metrics.render()
