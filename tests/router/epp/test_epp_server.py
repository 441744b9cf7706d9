"""kvroute's endpoint picker over real gRPC on 127.0.0.1, in front of real HTTP workers.

The tests speak Envoy's side of ext_proc with the generated client stub and check each
answer's fields: the destination header and metadata, the route cache, immediate errors, the
full-duplex body hand-back, the subset hint, the load booking and its release, and health.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import msgspec
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.up import free_port
from router.epp import DESTINATION_HEADER, epp_server
from router.service import RouterService
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker

BODY = {"model": "kvroute-sim", "prompt": "hello picker " * 8, "max_tokens": 4}
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def headers(path: str = "/v1/completions", end: bool = False) -> ep.ProcessingRequest:
    values = [base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
              base_pb2.HeaderValue(key=":method", raw_value=b"POST")]
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=values), end_of_stream=end))


def body(raw: bytes, end: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=end))


@contextlib.asynccontextmanager
async def picker_for(*workers: ScriptedWorker, **kw: Any
                     ) -> AsyncIterator[tuple[ep_grpc.ExternalProcessorStub, RouterService,
                                              grpc.aio.Channel]]:
    """An EPP on a free port in front of ``workers`` (all healthy), and a stub for it."""
    port = free_port()
    settings = RouterSettings(workers=tuple(w.url for w in workers), health_interval=0.1,
                              seed=3, **kw)
    async with (epp_server(settings, port, host="127.0.0.1") as service,
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel):
        yield ep_grpc.ExternalProcessorStub(channel), service, channel


async def exchange(stub: ep_grpc.ExternalProcessorStub, *requests: ep.ProcessingRequest
                   ) -> list[ep.ProcessingResponse]:
    """Send ``requests`` on one stream, close it, and collect every answer."""
    call = stub.Process()
    for r in requests:
        await call.write(r)
    await call.done_writing()
    return [answer async for answer in call]


def destination(common: ep.CommonResponse) -> str:
    (option,) = common.header_mutation.set_headers
    assert option.header.key == DESTINATION_HEADER
    return option.header.raw_value.decode()


def immediate(answer: ep.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    assert answer.WhichOneof("response") == "immediate_response"
    reply = answer.immediate_response
    content_type = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}
    assert content_type == {"content-type": b"application/json"}
    return reply.status.code, json.loads(reply.body)


async def test_a_buffered_request_is_sent_to_the_chosen_worker() -> None:
    async with ScriptedWorker() as w, picker_for(w) as (stub, service, _):
        answers = await exchange(stub, headers(), body(msgspec.json.encode(BODY)))
        assert [a.WhichOneof("response") for a in answers] == ["request_headers",
                                                               "request_body"]
        assert not answers[0].request_headers.HasField("response")  # headers pass unchanged
        routed = answers[1]
        assert destination(routed.request_body.response) == f"127.0.0.1:{w.port}"
        assert routed.request_body.response.clear_route_cache
        lb = routed.dynamic_metadata.fields["envoy.lb"].struct_value
        assert lb.fields[DESTINATION_HEADER].string_value == f"127.0.0.1:{w.port}"
        # The stream closed (Envoy's end of the request): nothing is left booked.
        assert service.core.in_flight(service.registry.entries()[0].id) == 0


async def test_a_booking_lasts_until_the_response_ends() -> None:
    async with ScriptedWorker() as w, picker_for(w) as (stub, service, _):
        worker = service.registry.entries()[0].id
        call = stub.Process()
        await call.write(headers("/v1/chat/completions"))
        await call.read()
        chat = {"model": "kvroute-sim", "messages": [{"role": "user", "content": "hi"}]}
        await call.write(body(msgspec.json.encode(chat)))
        assert (await call.read()).WhichOneof("response") == "request_body"
        assert service.core.in_flight(worker) == 1
        await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"x")))
        assert (await call.read()).WhichOneof("response") == "response_body"
        assert service.core.in_flight(worker) == 1
        await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(end_of_stream=True)))
        await call.read()
        assert service.core.in_flight(worker) == 0
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF


async def test_full_duplex_holds_headers_and_body_until_the_decision() -> None:
    raw = msgspec.json.encode(BODY)
    first = headers()
    first.protocol_config.request_body_mode = FULL_DUPLEX
    async with ScriptedWorker() as w, picker_for(w) as (stub, _, _):
        answers = await exchange(stub, first, body(raw[:10], end=False), body(raw[10:]))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert destination(answers[0].request_headers.response) == f"127.0.0.1:{w.port}"
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == raw and streamed.end_of_stream


async def test_full_duplex_body_ending_in_trailers_is_decided_at_the_trailers() -> None:
    raw = msgspec.json.encode(BODY)
    first = headers()
    first.protocol_config.request_body_mode = FULL_DUPLEX
    trailers = ep.ProcessingRequest(request_trailers=ep.HttpTrailers())
    async with ScriptedWorker() as w, picker_for(w) as (stub, _, _):
        answers = await exchange(stub, first, body(raw, end=False), trailers)
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers", "request_body", "request_trailers"]
    assert destination(answers[0].request_headers.response) == f"127.0.0.1:{w.port}"
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == raw and not streamed.end_of_stream


async def test_bad_bodies_get_openai_errors_and_the_stream_server_stays_up() -> None:
    async with ScriptedWorker() as w, picker_for(w) as (stub, _, _):
        answers = await exchange(stub, headers(), body(b"{not json"))
        status, error = immediate(answers[-1])
        assert status == 400 and error["error"]["type"] == "invalid_request_error"
        answers = await exchange(stub, headers(), body(b'{"model": "kvroute-sim"}'))
        assert immediate(answers[-1])[0] == 400  # neither prompt nor messages
        answers = await exchange(stub, headers(), body(msgspec.json.encode(
            {**BODY, "model": "nope"})))
        assert immediate(answers[-1])[1]["error"]["code"] == "model_not_found"
        answers = await exchange(stub, headers("/v1/models", end=True))
        # no body to route by: any worker, named on the headers answer
        assert destination(answers[-1].request_headers.response) == f"127.0.0.1:{w.port}"
        answers = await exchange(stub, headers(), body(msgspec.json.encode(BODY)))
        assert destination(answers[-1].request_body.response) == f"127.0.0.1:{w.port}"


async def test_no_healthy_worker_is_an_immediate_503() -> None:
    async with ScriptedWorker() as w:
        port = w.port
    async with picker_for_url(f"http://127.0.0.1:{port}") as stub:
        answers = await exchange(stub, headers(), body(msgspec.json.encode(BODY)))
    status, error = immediate(answers[-1])
    assert status == 503 and error["error"]["type"] == "service_unavailable"
    async with picker_for_url(f"http://127.0.0.1:{port}") as stub:
        answers = await exchange(stub, headers("/v1/models", end=True))
    assert immediate(answers[-1])[0] == 503


@contextlib.asynccontextmanager
async def picker_for_url(url: str) -> AsyncIterator[ep_grpc.ExternalProcessorStub]:
    port = free_port()
    settings = RouterSettings(workers=(url,), health_interval=0.1)
    async with (epp_server(settings, port, host="127.0.0.1"),
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel):
        yield ep_grpc.ExternalProcessorStub(channel)


async def test_the_subset_hint_limits_the_choice() -> None:
    async with ScriptedWorker() as a, ScriptedWorker() as b, picker_for(a, b) as (stub, _, _):
        for allowed in (a, b, a):
            first = headers()
            subset = first.metadata_context.filter_metadata["envoy.lb.subset_hint"]
            subset.update({"x-gateway-destination-endpoint-subset": [
                f"127.0.0.1:{allowed.port}"]})
            answers = await exchange(stub, first, body(msgspec.json.encode(BODY)))
            assert destination(answers[-1].request_body.response) == \
                f"127.0.0.1:{allowed.port}"
        first = headers()
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(
            struct_pb2.Struct(fields={"x-gateway-destination-endpoint-subset": struct_pb2.Value(
                string_value="10.0.0.1:8000")}))
        answers = await exchange(stub, first, body(msgspec.json.encode(BODY)))
        assert immediate(answers[-1])[0] == 503


async def test_health_follows_the_workers() -> None:
    async with ScriptedWorker() as w, picker_for(w) as (_, service, channel):
        health = health_pb2_grpc.HealthStub(channel)

        async def status(name: str) -> int:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            return reply.status  # type: ignore[no-any-return]

        serving = health_pb2.HealthCheckResponse.SERVING
        await eventually(lambda: status("readiness"), "readiness serving",
                         until=lambda s: s == serving)
        for name in ("liveness", "readiness", "",
                     "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await status(name) == serving, name
        await service.registry.remove(service.registry.entries()[0].id)
        await eventually(lambda: status("readiness"), "readiness not serving",
                         until=lambda s: s != serving)
        assert await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("liveness") == serving


async def test_metrics_count_decisions_and_refusals_over_http() -> None:
    grpc_port, metrics_port = free_port(), free_port()
    async with ScriptedWorker() as w:
        settings = RouterSettings(workers=(w.url,), health_interval=0.1)
        async with (epp_server(settings, grpc_port, host="127.0.0.1",
                               metrics_port=metrics_port),
                    grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}") as http):
            stub = ep_grpc.ExternalProcessorStub(channel)
            await exchange(stub, headers(), body(msgspec.json.encode(BODY)))
            await exchange(stub, headers(), body(msgspec.json.encode({**BODY, "model": "x"})))
            await exchange(stub, headers(), body(b"{not json"))
            text = (await http.get("/metrics")).text
            ready = await http.get("/ready")
    assert 'kvroute_requests_total{endpoint="ext_proc",status="200"} 1.0' in text
    assert 'kvroute_requests_total{endpoint="ext_proc",status="404"} 1.0' in text
    assert 'kvroute_requests_total{endpoint="ext_proc",status="400"} 1.0' in text
    assert "kvroute_decision_seconds_count 1.0" in text
    assert ready.status_code == 200 and ready.json() == {"ready": True, "workers": 1}


async def test_bytes_that_are_not_a_message_end_the_stream_with_invalid_argument(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    grpc_port, metrics_port = free_port(), free_port()
    async with ScriptedWorker() as w:
        settings = RouterSettings(workers=(w.url,), health_interval=0.1)
        async with (epp_server(settings, grpc_port, host="127.0.0.1",
                               metrics_port=metrics_port),
                    grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}") as http):
            # the method's path with no (de)serializer: the bytes go out as they are
            raw = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in raw(iter([b"\xff\xff\xff not a protobuf message"])):
                    pass
            text = (await http.get("/metrics")).text
            answers = await exchange(ep_grpc.ExternalProcessorStub(channel), headers(),
                                     body(msgspec.json.encode(BODY)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not an ext_proc ProcessingRequest" in (refused.value.details() or "")
    assert "kvroute_epp_malformed_messages_total 1.0" in text
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    noted = [r for r in caplog.records if r.name == "router.epp.server"]
    assert len(noted) == 1 and noted[0].levelno == logging.WARNING
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_a_held_body_is_refused_once_it_passes_the_limit_before_its_end() -> None:
    # Full duplex: chunks are held until end_of_stream. The picker refuses as soon as what it
    # holds passes max_body_bytes, not at the end, so a client that never ends its body holds
    # at most the limit in the picker.
    first = headers()
    first.protocol_config.request_body_mode = FULL_DUPLEX
    chunk = b"x" * 600
    grpc_port, metrics_port = free_port(), free_port()
    async with ScriptedWorker() as w:
        settings = RouterSettings(workers=(w.url,), health_interval=0.1, max_body_bytes=1000)
        async with (epp_server(settings, grpc_port, host="127.0.0.1",
                               metrics_port=metrics_port),
                    grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}") as http):
            stub = ep_grpc.ExternalProcessorStub(channel)
            # 1,200 bytes held after the second chunk, and no end_of_stream ever.
            answers = await exchange(stub, first, body(chunk, end=False),
                                     body(chunk, end=False), body(chunk, end=False))
            text = (await http.get("/metrics")).text
    assert len(answers) == 1
    status, error = immediate(answers[0])
    assert status == 413
    assert error["error"]["message"] == "the request body is over 1000 bytes"
    assert 'kvroute_requests_total{endpoint="ext_proc",status="413"} 1.0' in text
