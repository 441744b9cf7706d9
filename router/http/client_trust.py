"""Which clients may tell flow control who they are and how urgent they are.

Flow control (:mod:`router.http.flow`) reads a request's tenant, priority and deadline from
what the request says: the ``x-kvroute-tenant`` header or the gateway's
``x-gateway-inference-fairness-id``, the ``x-kvroute-priority`` header, the gateway's
``x-gateway-inference-objective`` or the body's ``priority``, and the
``x-kvroute-ttft-deadline-ms`` header. On a fleet shared by clients who do not trust each
other, a client that may say these takes any tenant's weight and goes ahead of everyone, so
they are believed only from the peers ``trusted_clients`` names (:mod:`httpapi.trusted_peers`;
loopback by default: a gateway or sidecar on the same host, a test, a laptop). Behind a
gateway elsewhere, the operator names the gateway's addresses; ``any`` trusts every client.

From any other peer (:func:`flow_view`):

1. the headers of :data:`FLOW_HEADERS` are ignored, as if absent, and not sent upstream;
2. the body's ``priority`` is ignored by flow control (the body goes upstream unchanged: an
   engine that schedules by it, vLLM's ``--scheduling-policy priority``, still reads it);
3. the tenant is what the client cannot choose as freely: a hash of its ``cache_salt``, else
   of its API key (:func:`router.http.flow.tenant_of`).

Nothing is refused: a client that sends these headers to a router that does not believe it
is served as one that did not send them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.http.flow import FAIRNESS_HEADER, OBJECTIVE_HEADER

__all__ = ["FLOW_HEADERS", "flow_view"]

#: The request headers flow control reads.
FLOW_HEADERS = ("x-kvroute-tenant", "x-kvroute-priority", "x-kvroute-ttft-deadline-ms",
                FAIRNESS_HEADER, OBJECTIVE_HEADER)


def flow_view(body: Mapping[str, Any], headers: Mapping[str, str], trusted: bool
              ) -> tuple[Mapping[str, Any], Mapping[str, str]]:
    """The body and headers flow control may read from a request (rules 1-3): as they are
    from a trusted client, else without the flow headers and the body's ``priority``.
    ``headers`` has lower-cased names, as an ASGI scope gives them."""
    if trusted:
        return body, headers
    if "priority" in body:
        body = {k: v for k, v in body.items() if k != "priority"}
    if any(name in headers for name in FLOW_HEADERS):
        headers = {k: v for k, v in headers.items() if k not in FLOW_HEADERS}
    return body, headers
