"""A do-nothing ext_proc server: the floor under ``kvroute epp``'s cost per request.

It speaks the same conversation as the endpoint picker over the same runtime (grpcio
asyncio): it lets the request headers through and answers the buffered body with the answer
that routes to ``--endpoint`` (:func:`router.epp.messages.routed`), deciding nothing.
:mod:`bench.epp` puts it behind its own Envoy and measures its CPU per request beside the
EPP's, so the EPP's figure reads as this floor plus the routing work.

Run: ``python -m bench.ext_proc_floor --grpc-port 9002 --endpoint 127.0.0.1:8000``.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.epp import messages


class FloorProcessor(ep_grpc.ExternalProcessorServicer):
    """Routes every request to one endpoint; reads and writes exactly as the EPP does."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint

    async def Process(self, request_iterator: object,
                      context: grpc.aio.ServicerContext) -> None:
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                return
            await context.write(self._answer(request))

    def _answer(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        if request.WhichOneof("request") == "request_headers":
            return messages.continue_headers()
        return messages.routed(self._endpoint, "request_body")


async def serve(grpc_port: int, endpoint: str) -> None:
    """Serve ext_proc and gRPC health (``readiness`` serving) on 127.0.0.1 until killed."""
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(FloorProcessor(endpoint), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("readiness", health_pb2.HealthCheckResponse.SERVING)
    if server.add_insecure_port(f"127.0.0.1:{grpc_port}") == 0:
        raise SystemExit(f"cannot listen on 127.0.0.1:{grpc_port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--endpoint", required=True, help="host:port every request goes to")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.grpc_port, args.endpoint))


if __name__ == "__main__":
    main()
