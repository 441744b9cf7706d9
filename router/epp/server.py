"""``kvroute epp``: the router's state behind Envoy's external processing API over gRPC.

The process holds one :class:`~router.service.RouterService`, built from the same settings as
``kvroute router`` (workers from flags, config file or discovery; their KV events subscribed;
their load polled), and serves two gRPC services on ``--grpc-port``:

- ``envoy.service.ext_proc.v3.ExternalProcessor``: one :class:`~router.epp.exchange.Exchange`
  per HTTP request;
- ``grpc.health.v1.Health``: ``liveness`` serves while the process runs; ``readiness``, the
  empty service name and the ext_proc service name serve while a worker is healthy;

and, with ``--metrics-port``, the HTTP router's Prometheus metrics (``/metrics``; decisions
counted under the endpoint ``ext_proc``), ``/ready`` and ``/health`` over HTTP.

A bug in handling one request answers that request with a 500 and leaves the stream and the
server running. Bytes that are not a ``ProcessingRequest`` end their stream with
``INVALID_ARGUMENT``, one logged line and a count in ``kvroute_epp_malformed_messages_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import grpc
import httpx
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter

from openai_request.bodies import ApiError
from router.epp import messages
from router.epp.exchange import Exchange
from router.epp.picker import Picker
from router.service import RouterService
from router.settings import RouterSettings

__all__ = ["ExternalProcessor", "epp_server", "run_epp"]

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_READY_NAMES = ("", "readiness", EXT_PROC_SERVICE)


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """The ext_proc service: reads each stream's messages, answers through an Exchange."""

    def __init__(self, picker: Picker) -> None:
        self._picker = picker
        self._malformed = Counter("kvroute_epp_malformed_messages",
                                  "ext_proc messages that were not a ProcessingRequest",
                                  registry=picker.metrics.registry)

    async def Process(self, request_iterator: object,
                      context: grpc.aio.ServicerContext) -> None:
        exchange = Exchange(self._picker)
        try:
            while True:
                try:
                    request = await context.read()
                except DecodeError as exc:  # the stream's bytes are garbage: end it
                    self._malformed.inc()
                    log.warning("ext_proc stream from %s sent a malformed message: %s",
                                context.peer(), exc)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "a message was not an ext_proc ProcessingRequest")
                if request is grpc.aio.EOF:
                    return
                try:
                    answers = exchange.on_message(request)
                    if exchange.held is not None:  # the fleet is saturated: wait in the queue
                        answers = [*answers, *await exchange.admitted()]
                except Exception:  # one request's bug must not stop the stream or server
                    log.exception("endpoint picker failed on a request")
                    answers = [messages.immediate_error(ApiError(
                        500, "the endpoint picker failed on this request", "server_error"))]
                for answer in answers:
                    await context.write(answer)
        finally:
            exchange.close()


async def _watch_readiness(picker: Picker, servicer: health.aio.HealthServicer,
                           interval: float) -> None:
    serving = None
    while True:
        now = picker.ready()
        if now != serving:
            serving = now
            status = (health_pb2.HealthCheckResponse.SERVING if now
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in _READY_NAMES:
                await servicer.set(name, status)
        await asyncio.sleep(interval)


def _metrics_app(picker: Picker) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body, content_type = picker.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def ready(_: web.Request) -> web.Response:
        healthy = len(picker.service.candidates())
        if healthy == 0:
            reason = picker.service.unavailable()
            return web.json_response({"ready": False, "reason": f"no healthy worker: {reason}"},
                                     status=503)
        return web.json_response({"ready": True, "workers": healthy})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/ready", ready)
    app.router.add_get("/health", health)
    return app


@contextlib.asynccontextmanager
async def epp_server(settings: RouterSettings, grpc_port: int, host: str | None = None,
                     metrics_port: int | None = None) -> AsyncIterator[RouterService]:
    """Run the endpoint picker until the block exits; yields the router service it serves.

    Args:
        settings: the router's frozen settings (workers, discovery, routing).
        grpc_port: the port the gRPC services listen on.
        host: the bind address (default: ``settings.host``).
        metrics_port: where to serve ``/metrics`` (Prometheus), ``/ready`` and ``/health``
            over HTTP; none when not given.

    Raises:
        RuntimeError: a port could not be bound.
    """
    http = httpx.AsyncClient()
    service = RouterService(settings, http)
    picker = Picker(service)
    runner: web.AppRunner | None = None
    if metrics_port is not None:
        runner = web.AppRunner(_metrics_app(picker), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host or settings.host, metrics_port).start()
        except OSError as exc:
            await runner.cleanup()
            await http.aclose()
            raise RuntimeError(f"cannot serve metrics on port {metrics_port}: {exc}") from None
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host or settings.host}:{grpc_port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio's own "Failed to bind" (its message points at its logs)
        bound = 0
    if bound == 0:
        if runner is not None:
            await runner.cleanup()
        await http.aclose()
        raise RuntimeError(f"cannot listen on {address}: the address is in use or invalid")
    await health_servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    for name in _READY_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await service.start()
    await server.start()
    watcher = asyncio.create_task(
        _watch_readiness(picker, health_servicer, min(settings.health_interval, 1.0)),
        name="kvroute-epp-readiness")
    try:
        yield service
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await health_servicer.enter_graceful_shutdown()
        await picker.flow.close()  # every request still held is answered 503
        await server.stop(grace=5)
        await service.stop()
        if runner is not None:
            await runner.cleanup()
        await http.aclose()


async def _serve_until_signal(settings: RouterSettings, grpc_port: int,
                              metrics_port: int | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with epp_server(settings, grpc_port, metrics_port=metrics_port):
        log.info("endpoint picker serving ext_proc on %s:%d", settings.host, grpc_port)
        await stop.wait()


def run_epp(settings: RouterSettings, grpc_port: int, metrics_port: int | None = None) -> int:
    """Serve the endpoint picker until SIGINT or SIGTERM; returns the exit status."""
    try:
        asyncio.run(_serve_until_signal(settings, grpc_port, metrics_port))
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    return 0
