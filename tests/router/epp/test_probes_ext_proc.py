"""Probes of the endpoint picker's side of an ext_proc stream (:class:`router.epp.exchange.
Exchange`), message by message as Envoy would send them, and as a broken or hostile data plane
might: headers only, a body before its headers, headers twice, a response before any request,
trailers alone, bodies after the end, a declared length far past the limit, lengths that are
not numbers, bodies over the limit, messages with no phase. For every probe: no exception,
each answer a well-formed ``ProcessingResponse``, a refusal an immediate 4xx/5xx, and memory
held bounded by the body limit (a declared length is never trusted to size anything)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from router.epp.exchange import Exchange
from router.epp.picker import Picker
from tests.router.epp.test_streamed_exchange import PROMPT, headers, http, service_for

__all__ = ["http"]  # the fixture

LIMIT = 256 * 1024
BODY = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 2}).encode()


def body(raw: bytes, end: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=end))


def chunks(raw: bytes, size: int = 4096) -> list[ep.ProcessingRequest]:
    return [body(raw[i:i + size], i + size >= len(raw)) for i in range(0, len(raw), size)]


def with_length(value: str) -> ep.ProcessingRequest:
    request = headers("/v1/completions", None)
    request.request_headers.headers.headers.append(
        base_pb2.HeaderValue(key="content-length", raw_value=value.encode()))
    return request


def headers_only() -> ep.ProcessingRequest:
    request = headers("/v1/completions", None)
    request.request_headers.end_of_stream = True
    return request


PROBES: dict[str, Callable[[], list[ep.ProcessingRequest]]] = {
    "a whole body": lambda: [headers("/v1/completions", len(BODY)), *chunks(BODY)],
    "headers only": lambda: [headers_only()],
    "a body before its headers": lambda: [*chunks(BODY)],
    "headers twice": lambda: [headers("/v1/completions", len(BODY)),
                              headers("/v1/completions", len(BODY)), *chunks(BODY)],
    "a response before any request": lambda: [
        ep.ProcessingRequest(response_headers=ep.HttpHeaders()),
        ep.ProcessingRequest(response_body=ep.HttpBody(body=b"x", end_of_stream=True))],
    "trailers alone": lambda: [ep.ProcessingRequest(request_trailers=ep.HttpTrailers())],
    "a body after its end": lambda: [headers("/v1/completions", len(BODY)), *chunks(BODY),
                                     body(b"more", True)],
    "a declared length of 10**15": lambda: [with_length(str(10**15)), *chunks(BODY)],
    "a declared length of 10**400": lambda: [with_length("1" + "0" * 400), *chunks(BODY)],
    "a declared length that is negative": lambda: [with_length("-5"), *chunks(BODY)],
    "a declared length in unicode digits": lambda: [with_length("١٢٣"), *chunks(BODY)],
    "a body over the limit": lambda: [headers("/v1/completions", None),
                                      *chunks(b'{"prompt": "' + b"x" * (LIMIT + 10) + b'"}')],
    "a message with no phase": lambda: [ep.ProcessingRequest()],
    "an unknown path": lambda: [headers("/v2/secret", len(BODY)), *chunks(BODY)],
    "not JSON": lambda: [headers("/v1/completions", 9), body(b"not json!", True)],
    "a header of non-UTF-8 bytes": lambda: [_odd_header(), *chunks(BODY)],
    "10,000 empty body messages": lambda: [headers("/v1/completions", None),
                                           *[body(b"", False) for _ in range(10_000)],
                                           body(BODY, True)],
}


def _odd_header() -> ep.ProcessingRequest:
    request = headers("/v1/completions", len(BODY))
    request.request_headers.headers.headers.append(
        base_pb2.HeaderValue(key="x-kvroute-tenant", raw_value=b"\xff\xfe\x00"))
    return request


@pytest.mark.parametrize("messages", PROBES.values(), ids=PROBES.keys())
def test_ext_proc_probe(tmp_path: Path, http: httpx.AsyncClient,
                        messages: Callable[[], list[ep.ProcessingRequest]]) -> None:
    service = service_for(tmp_path, http)
    object.__setattr__(service.settings, "max_body_bytes", LIMIT)
    exchange = Exchange(Picker(service))
    for message in messages():
        for answer in exchange.on_message(message):
            assert isinstance(answer, ep.ProcessingResponse)
            assert answer.WhichOneof("response") is not None
            if answer.WhichOneof("response") == "immediate_response":
                assert answer.immediate_response.status.code >= 400
        assert exchange._held_bytes <= LIMIT + 4096
    exchange.close()


@pytest.mark.parametrize("tail", [b', "model": "other"}', b', "kv_transfer_params": {"x": 1}}'],
                         ids=["a repeated model", "a transfer field"])
def test_a_body_decided_early_is_refused_at_its_end_when_whole_it_would_be(
        tmp_path: Path, http: httpx.AsyncClient, tail: bytes) -> None:
    # Decided on its first part, then its end repeats the model (or sets a field the router
    # sets): the last chunk is not sent on; the request ends in a 400 instead.
    from tests.router.epp.test_streamed_exchange import streamed
    raw = BODY[:-1] + tail
    exchange, answers = streamed(service_for(tmp_path, http), "/v1/completions", raw)
    assert exchange.early
    last = answers[-1]
    assert [a.WhichOneof("response") for a in last] == ["immediate_response"]
    assert last[0].immediate_response.status.code == 400
    sent_end = [a for batch in answers for a in batch
                if a.WhichOneof("response") == "request_body"
                and a.request_body.response.body_mutation.streamed_response.end_of_stream]
    assert sent_end == []
    exchange.close()
