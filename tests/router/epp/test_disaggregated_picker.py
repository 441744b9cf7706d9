"""The endpoint picker for disaggregated serving, over real gRPC in front of real HTTP
workers: the decode worker as destination, the prefill worker in llm-d's
``x-prefiller-host-port`` header (the routing sidecar's protocol), and both bookings."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvroute.up import free_port
from router.epp import DESTINATION_HEADER, PREFILLER_HEADER, epp_server
from router.fleet.ranks import RANK_HEADER
from router.service import RouterService
from router.settings import RouterSettings
from tests.router.epp.test_epp_server import FULL_DUPLEX, body, exchange, headers
from tests.support.servers import ScriptedWorker

#: 27 blocks of prompt: far more than the decode worker holds, so it is prefilled remotely.
BODY = {"model": "kvroute-sim", "prompt": "disaggregated picker " * 40, "max_tokens": 4}


@contextlib.asynccontextmanager
async def pd_picker(prefill: ScriptedWorker, decode: ScriptedWorker, **kw: Any
                    ) -> AsyncIterator[tuple[ep_grpc.ExternalProcessorStub, RouterService]]:
    port = free_port()
    settings = RouterSettings(workers=(f"{prefill.url},role=prefill",
                                       f"{decode.url},role=decode"),
                              health_interval=0.1, seed=3, **kw)
    async with (epp_server(settings, port, host="127.0.0.1") as service,
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel):
        yield ep_grpc.ExternalProcessorStub(channel), service


def mutation(common: ep.CommonResponse) -> tuple[dict[str, str], list[str]]:
    """The headers an answer sets, and those it removes."""
    changed = common.header_mutation
    return ({o.header.key: o.header.raw_value.decode() for o in changed.set_headers},
            list(changed.remove_headers))


async def test_the_decode_worker_is_the_destination_and_the_prefill_worker_the_header(
        ) -> None:
    async with (ScriptedWorker() as prefill, ScriptedWorker() as decode,
                pd_picker(prefill, decode) as (stub, service)):
        answers = await exchange(stub, headers(), body(msgspec.json.encode(BODY)))
        routed = answers[-1]
        set_headers, removed = mutation(routed.request_body.response)
        assert set_headers == {DESTINATION_HEADER: f"127.0.0.1:{decode.port}",
                               PREFILLER_HEADER: f"127.0.0.1:{prefill.port}"}
        assert removed == [RANK_HEADER]  # a client's rank header never picks a rank
        lb = routed.dynamic_metadata.fields["envoy.lb"].struct_value
        assert lb.fields[DESTINATION_HEADER].string_value == f"127.0.0.1:{decode.port}"
        assert service.counters.get("pd_remote_prefills") == 1


async def test_full_duplex_names_the_prefill_worker_on_the_headers_answer() -> None:
    raw = msgspec.json.encode(BODY)
    first = headers()
    first.protocol_config.request_body_mode = FULL_DUPLEX
    async with (ScriptedWorker() as prefill, ScriptedWorker() as decode,
                pd_picker(prefill, decode) as (stub, _)):
        answers = await exchange(stub, first, body(raw))
    set_headers, _ = mutation(answers[0].request_headers.response)
    assert set_headers[PREFILLER_HEADER] == f"127.0.0.1:{prefill.port}"
    assert set_headers[DESTINATION_HEADER] == f"127.0.0.1:{decode.port}"
    assert answers[1].request_body.response.body_mutation.streamed_response.body == raw


async def test_the_prefill_booking_ends_at_the_first_byte_and_the_decode_one_at_the_end(
        ) -> None:
    async with (ScriptedWorker() as prefill, ScriptedWorker() as decode,
                pd_picker(prefill, decode) as (stub, service)):
        p, d = (service.registry.find(w.url).id for w in (prefill, decode))
        call = stub.Process()
        await call.write(headers())
        await call.read()
        await call.write(body(msgspec.json.encode(BODY)))
        await call.read()
        # The sidecar now prefills on the prefill worker: both are booked.
        assert (service.core.in_flight(p), service.core.in_flight(d)) == (1, 1)
        assert service.core.pending_prefill(p) > 0
        assert service.core.pending_prefill(d) == 0  # its KV comes by transfer
        await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"x")))
        await call.read()
        assert (service.core.in_flight(p), service.core.in_flight(d)) == (0, 1)
        await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(end_of_stream=True)))
        await call.read()
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert (service.core.in_flight(p), service.core.in_flight(d)) == (0, 0)


async def test_a_stream_closed_before_any_answer_releases_both_bookings() -> None:
    async with (ScriptedWorker() as prefill, ScriptedWorker() as decode,
                pd_picker(prefill, decode) as (stub, service)):
        await exchange(stub, headers(), body(msgspec.json.encode(BODY)))
        for w in (prefill, decode):
            assert service.core.in_flight(service.registry.find(w.url).id) == 0


async def test_a_short_prompt_is_prefilled_on_the_decode_worker_and_a_clients_header_dropped(
        ) -> None:
    short = {**BODY, "prompt": "short"}
    async with (ScriptedWorker() as prefill, ScriptedWorker() as decode,
                pd_picker(prefill, decode) as (stub, service)):
        answers = await exchange(stub, headers(), body(msgspec.json.encode(short)))
        set_headers, removed = mutation(answers[-1].request_body.response)
        assert set_headers == {DESTINATION_HEADER: f"127.0.0.1:{decode.port}"}
        # A header the client sent cannot send the sidecar's prefill anywhere.
        assert removed == [RANK_HEADER, PREFILLER_HEADER]
        assert service.counters.get("pd_local_prefills") == 1
        assert "pd_remote_prefills" not in service.counters
