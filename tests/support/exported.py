"""The metric families kvroute exports, read from a real router's and a real worker's
registries: what the documentation check and the dashboard check compare against."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx

from httpapi.api_keys import KeyRing, hash_line, parse_keys
from httpapi.responses import disconnect_counter
from router.http.client_quotas import ClientAccess
from router.http.metrics import RouterMetrics
from router.service import RouterService
from router.settings import RouterSettings
from tests.fixtures.tokenizer_files import write_tiny_tokenizer
from workers.http.api import create_app
from workers.settings import WorkerSettings


def exported(text: str) -> set[str]:
    """The families in an exposition, as documented: counters with ``_total``, histograms
    without their sample suffixes (both as the ``# TYPE`` lines name them)."""
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def router_exposition() -> str:
    """The router's families, and the picker's own (``kvroute epp`` serves the router's)."""
    from router.epp.picker import Picker
    from router.epp.server import ExternalProcessor

    # A Hugging Face tokenizer: the segment cache's families show with one.
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = write_tiny_tokenizer(Path(folder))
        service = RouterService(RouterSettings(seed=1, tokenizer=str(tokenizer)),
                                httpx.AsyncClient())
    assert service.core.follows_sessions  # the session families show when on
    metrics = RouterMetrics(service)
    disconnect_counter(metrics.registry)  # the app registers it beside the metrics
    # With client API keys on, their families (router.http.client_quotas).
    ClientAccess(KeyRing(parse_keys(hash_line("k"))), 0, metrics.registry)
    ExternalProcessor(Picker(service, metrics))  # the picker registers flow control's
    return metrics.render()[0].decode()


async def worker_exposition() -> str:
    app = create_app(WorkerSettings(events_port=0, replay_port=0, speedup=1e6))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://worker") as client:
        return (await client.get("/metrics")).text
