"""bench.epp's in-process part runs the EPP's real exchange and leaves nothing booked; the
do-nothing ext_proc server it measures beside the EPP answers like the EPP, over real gRPC;
the large-body parts (paced sends, the in-process streamed and buffered exchanges, the
fixed-answer worker) work on a small tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

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


def test_the_large_body_parts_run_the_real_exchange_and_worker(tmp_path: Path) -> None:
    import httpx

    from bench.epp import _FixedWorker, _in_process_ms, _paced
    from openai_request.tokenizer import load_tokenizer
    from tests.fixtures.tokenizer_files import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path)
    raw = json.dumps({"model": "kvroute-sim", "prompt": "FIRST " + "words of a prompt " * 3000
                      }).encode()
    assert b"".join(_paced(raw, 1e4)) == raw
    for streamed in (False, True):
        figure = _in_process_ms(tmp_path, raw, streamed, n=2)
        assert math.isfinite(figure) and figure > 0
    identity = load_tokenizer(str(tmp_path)).identity
    with _FixedWorker(identity) as worker:
        base = f"http://127.0.0.1:{worker.port}"
        assert httpx.get(f"{base}/model_info").json()["tokenizer"] == identity
        answer = httpx.post(f"{base}/v1/completions", content=raw)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "x"
