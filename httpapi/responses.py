"""How both apps answer a refusal and count clients that left before their answer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from starlette.responses import JSONResponse

from httpapi.refusals import register_refusals
from openai_request.bodies import ApiError, error_body

__all__ = ["CLIENT_GONE_STATUS", "DISCONNECT_STAGES", "disconnect_counter", "error_response"]

#: The status logged for a request whose client left (nginx's convention; nobody reads it).
CLIENT_GONE_STATUS = 499
#: Where a client may leave before its answer: sending its ``body``, waiting in the router's
#: flow-control ``queue``, waiting for its ``answer`` (the counter's whole label set).
DISCONNECT_STAGES = ("body", "queue", "answer")


def error_response(error: ApiError) -> JSONResponse:
    """The OpenAI-style JSON answer for ``error``; a 413 or 408 also closes the connection."""
    headers = getattr(error, "headers", None)
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def disconnect_counter(registry: CollectorRegistry,
                       stages: tuple[str, ...] = ("body", "answer")) -> Counter:
    """The ``kvroute_client_disconnects_total`` counter on ``registry``: one count per client
    that left before its answer, in place of a logged traceback for each, shown from the
    start for each of ``stages`` (of :data:`DISCONNECT_STAGES`). The registry also shows the
    HTTP server's refusals (:func:`httpapi.refusals.register_refusals`)."""
    assert set(stages) <= set(DISCONNECT_STAGES), f"unknown stages in {stages}"
    register_refusals(registry)
    counter = Counter("kvroute_client_disconnects",
                      "Clients that closed their connection before their answer, by stage",
                      ["stage"], registry=registry)
    for stage in stages:
        counter.labels(stage)
    return counter
