"""Flow control in the endpoint picker, over real gRPC on 127.0.0.1: while the fleet is
saturated a request's ext_proc stream is held unanswered and routed when a booking ends, the
most urgent first (its priority from the InferenceObjective the gateway names); one that
cannot meet its deadline gets an immediate 429 with ``Retry-After``.

As in the HTTP router's flow-control tests the rates are set by hand (a millisecond of
prefill per token, nothing learned) and the bound is 0.2 s, so one booked prompt of 7 blocks
(0.224 s of predicted prefill) saturates the only worker. Envoy's side is the generated stub;
a booking ends when its stream sends the response's last body chunk. Each step waits
(bounded) for a state the picker reports on ``/metrics``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvroute.up import free_port
from router.epp import DESTINATION_HEADER, epp_server
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker

#: 7 full blocks of 32 byte-tokens: 0.224 s of predicted prefill, past the bound of 0.2 s.
SHORT = 7 * 32 + 8


def request_headers(**extra: str) -> ep.ProcessingRequest:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
              {":path": "/v1/completions", ":method": "POST", **extra}.items()]
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=values)))


def request_body(tag: str, **extra: Any) -> ep.ProcessingRequest:
    text = f"<{tag}>"
    raw = json.dumps({"model": "kvroute-sim", "prompt": text + "x" * (SHORT - len(text)),
                      "max_tokens": 1, **extra}).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True))


RESPONSE_END = ep.ProcessingRequest(response_body=ep.HttpBody(body=b"x", end_of_stream=True))


@contextlib.asynccontextmanager
async def picker(w: ScriptedWorker, **kw: Any
                 ) -> AsyncIterator[tuple[ep_grpc.ExternalProcessorStub, httpx.AsyncClient]]:
    grpc_port, metrics_port = free_port(), free_port()
    settings = RouterSettings(workers=(w.url,), health_interval=0.1, seed=3,
                              rates="prefill=0.001", learn_rates=False, flow_ttft_bound=0.2,
                              **kw)
    async with (epp_server(settings, grpc_port, host="127.0.0.1", metrics_port=metrics_port),
                grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}") as http):
        await eventually(lambda: http.get("/ready"), "the worker ready",
                         until=lambda r: r.status_code == 200)
        yield ep_grpc.ExternalProcessorStub(channel), http


async def queued(http: httpx.AsyncClient) -> int:
    text = (await http.get("/metrics")).text
    return int(sum(float(v) for v in re.findall(r"^kvroute_flow_queued\{[^}]*\} (\S+)$",
                                                  text, re.M)))


async def until_queued(http: httpx.AsyncClient, n: int) -> None:
    async def probe() -> int:
        return await queued(http)
    await eventually(probe, f"{n} held in the picker's queue", 30.0, until=lambda v: v == n)


async def opened(stub: ep_grpc.ExternalProcessorStub, body: ep.ProcessingRequest,
                 **headers: str) -> Any:
    """A stream that has sent its headers and body (its headers answered)."""
    call = stub.Process()
    await call.write(request_headers(**headers))
    assert (await call.read()).WhichOneof("response") == "request_headers"
    await call.write(body)
    return call


async def routed_to(call: Any) -> str:
    answer = await call.read()
    assert answer.WhichOneof("response") == "request_body", answer
    (option,) = answer.request_body.response.header_mutation.set_headers
    assert option.header.key == DESTINATION_HEADER
    return str(option.header.raw_value.decode())


async def end(call: Any) -> None:
    """The response ends: its booking is released."""
    await call.write(RESPONSE_END)
    assert (await call.read()).WhichOneof("response") == "response_body"
    await call.done_writing()


async def test_a_saturated_fleet_holds_streams_and_routes_the_most_urgent_objective_first(
        ) -> None:
    async with ScriptedWorker("paced") as w, picker(
            w, objective_priorities="critical=10,sheddable=-5") as (stub, http):
        endpoint = w.url.removeprefix("http://")
        first = await opened(stub, request_body("first"))
        assert await routed_to(first) == endpoint  # the worker is saturated now
        low = await opened(stub, request_body("low"),
                           **{"x-gateway-inference-objective": "sheddable"})
        await until_queued(http, 1)
        urgent = await opened(stub, request_body("urgent"),
                              **{"x-gateway-inference-objective": "critical"})
        await until_queued(http, 2)
        text = (await http.get("/metrics")).text
        # GIE's priority 10 is flow control's -10 (lower first), -5 is 5.
        assert set(re.findall(r'^kvroute_flow_queued\{priority="(-?\d+)"', text, re.M)) == {
            "-10", "5"}
        await end(first)  # room again: the urgent one leaves first, though it came second
        assert await routed_to(urgent) == endpoint
        await until_queued(http, 1)
        await end(urgent)
        assert await routed_to(low) == endpoint
        await until_queued(http, 0)
        await end(low)
        text = (await http.get("/metrics")).text
    assert 'kvroute_requests_total{endpoint="ext_proc",status="200"} 3.0' in text
    assert re.search(r'^kvroute_flow_wait_seconds_count\{priority="-10",tenant="other"\} 1.0$',
                     text, re.M)


async def test_an_unmeetable_deadline_is_an_immediate_429_with_retry_after() -> None:
    async with ScriptedWorker("paced") as w, picker(w) as (stub, http):
        first = await opened(stub, request_body("first"))
        await routed_to(first)
        waiting = await opened(stub, request_body("waiting"),
                               **{"x-gateway-inference-fairness-id": "team-a"})
        await until_queued(http, 1)
        late = await opened(stub, request_body("late"), **{"x-kvroute-ttft-deadline-ms": "100"})
        answer = await late.read()
        assert answer.WhichOneof("response") == "immediate_response"
        reply = answer.immediate_response
        sent = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}
        assert reply.status.code == 429 and int(sent["retry-after"]) >= 1
        assert json.loads(reply.body)["error"]["code"] == "deadline_unmeetable"
        await late.done_writing()
        await end(first)
        await routed_to(waiting)
        await end(waiting)
        text = (await http.get("/metrics")).text
    assert 'kvroute_requests_total{endpoint="ext_proc",status="429"} 1.0' in text
    assert re.search(r'^kvroute_flow_shed_total\{[^}]*reason="deadline"[^}]*\} 1.0$', text, re.M)


async def test_a_stream_that_ends_while_held_leaves_the_queue() -> None:
    async with ScriptedWorker("paced") as w, picker(w) as (stub, http):
        first = await opened(stub, request_body("first"))
        await routed_to(first)
        gone = await opened(stub, request_body("gone"))
        await until_queued(http, 1)
        gone.cancel()  # Envoy drops the stream: the client went away
        await until_queued(http, 0)
        await end(first)
