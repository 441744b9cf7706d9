"""The ext_proc wire, read and written in one place (the generated ``xds-protos`` stubs).

The Gateway API Inference Extension's endpoint picker protocol rides on Envoy's external
processing API: the EPP names the chosen endpoint in the ``x-gateway-destination-endpoint``
request header and under the same key in the ``envoy.lb`` dynamic metadata namespace, and
clears the route cache so the new header is routed on. For disaggregated serving the
destination is the decode worker, and the prefill worker rides in llm-d's
``x-prefiller-host-port`` request header (``host:port``): the routing sidecar beside the decode
engine runs the prefill there first (vLLM's ``kv_transfer_params`` two-step), then hands the
request to its own engine; without the header it serves the request locally. A request it
refuses gets an ``ImmediateResponse`` carrying an OpenAI-style JSON error. The data plane may
restrict the choice with ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``
in the request's filter metadata.
"""

from __future__ import annotations

import functools
import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from openai_request.bodies import ApiError, error_body
from router.fleet.ranks import RANK_HEADER

__all__ = [
    "DESTINATION_HEADER",
    "LB_NAMESPACE",
    "PREFILLER_HEADER",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "continue_body",
    "continue_headers",
    "continue_response_body",
    "continue_response_headers",
    "header",
    "header_map",
    "immediate_error",
    "routed",
    "subset_hint",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PREFILLER_HEADER = "x-prefiller-host-port"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


def header(headers: ep.HttpHeaders, name: str) -> str | None:
    """The value of header ``name`` (lower case) in ``headers``, or ``None``.

    Envoy sends values as ``raw_value`` bytes (older versions as ``value``).
    """
    for h in headers.headers.headers:
        if h.key == name:
            return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return None


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """Every header in ``headers`` by its (lower-case) name; a repeated one's last value."""
    return {h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
            for h in headers.headers.headers}


def subset_hint(request: ep.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the data plane allows for this request, or ``None`` when it sets none."""
    if not request.HasField("metadata_context"):
        return None
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(p.strip() for p in value.string_value.split(",") if p.strip())


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _destination(endpoint: str, prefiller: str | None, strip_rank: bool) -> ep.CommonResponse:
    options = [_set(DESTINATION_HEADER, endpoint)]
    # A client's own prefiller header must not pick the prefill worker: the router's choice
    # replaces it, and with no remote prefill it is removed. Nor may its data-parallel rank
    # header pick a rank (router.http.client_fields).
    removed = [RANK_HEADER] if strip_rank else []
    if prefiller is not None:
        options.append(_set(PREFILLER_HEADER, prefiller))
    else:
        removed.append(PREFILLER_HEADER)
    mutation = ep.HeaderMutation(set_headers=options, remove_headers=removed)
    return ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)


def _lb_metadata(endpoint: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION_HEADER] = endpoint
    return metadata


@functools.lru_cache(maxsize=4096)
def routed(endpoint: str, phase: str, prefiller: str | None = None, strip_rank: bool = True
           ) -> ep.ProcessingResponse:
    """The answer that sends the request to ``endpoint`` (one shared message per endpoint
    and phase: building it costs more than deciding; callers must not modify it).

    Args:
        endpoint: ``host:port`` of the chosen worker.
        phase: ``"request_body"`` (the buffered body was read) or ``"request_headers"``
            (the full-duplex headers answer, or a request without a body).
        prefiller: ``host:port`` of the prefill worker that prefills for ``endpoint`` (the
            ``x-prefiller-host-port`` header); ``None``: no remote prefill.
        strip_rank: have Envoy remove a client's ``X-data-parallel-rank``.
    """
    common = _destination(endpoint, prefiller, strip_rank)
    metadata = _lb_metadata(endpoint)
    if phase == "request_body":
        return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                     dynamic_metadata=metadata)
    assert phase == "request_headers", f"no routed answer for phase {phase!r}"
    return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                 dynamic_metadata=metadata)


def immediate_error(error: ApiError) -> ep.ProcessingResponse:
    """An ``ImmediateResponse``: Envoy answers the client with ``error`` and stops. Headers
    the error carries (a 429's ``retry-after``) ride along."""
    extra: dict[str, str] = getattr(error, "headers", None) or {}
    mutation = ep.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))
        for key, value in {"content-type": "application/json", **extra}.items()])
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status), headers=mutation,
        body=json.dumps(error_body(error)).encode(), details=f"kvroute_epp_{error.status}"))


@functools.cache
def continue_headers() -> ep.ProcessingResponse:
    """Let the request headers through unchanged (the decision waits for the body); one
    shared message, not to be modified."""
    return ep.ProcessingResponse(request_headers=ep.HeadersResponse())


@functools.cache
def continue_body() -> ep.ProcessingResponse:
    """Let a request body chunk through unchanged."""
    return ep.ProcessingResponse(request_body=ep.BodyResponse())


@functools.cache
def continue_response_headers() -> ep.ProcessingResponse:
    """Let the response headers through unchanged."""
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse())


@functools.cache
def continue_response_body() -> ep.ProcessingResponse:
    """Let a response body chunk through unchanged."""
    return ep.ProcessingResponse(response_body=ep.BodyResponse())
