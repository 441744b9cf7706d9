"""bench.epp's in-process part runs the EPP's real exchange and leaves nothing booked; the
do-nothing ext_proc server it measures beside the EPP answers like the EPP, over real gRPC."""

from __future__ import annotations

import math

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from bench.epp import exchange_cpu_us
from bench.ext_proc_floor import FloorProcessor
from router.epp import DESTINATION_HEADER


def test_the_exchange_figure_is_measured_on_the_real_exchange() -> None:
    figure = exchange_cpu_us(requests=20)
    assert math.isfinite(figure) and figure > 0


async def test_the_floor_server_routes_every_body_to_its_endpoint_over_grpc() -> None:
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(FloorProcessor("10.0.0.7:8000"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(ep.ProcessingRequest(request_headers=ep.HttpHeaders()))
            headers_answer = await call.read()
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(
                body=b'{"prompt": "x"}', end_of_stream=True)))
            body_answer = await call.read()
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
    finally:
        await server.stop(None)
    assert headers_answer.WhichOneof("response") == "request_headers"
    assert not headers_answer.request_headers.HasField("response")
    mutation = body_answer.request_body.response.header_mutation.set_headers
    assert [(h.header.key, h.header.raw_value) for h in mutation] == [
        (DESTINATION_HEADER, b"10.0.0.7:8000")]
