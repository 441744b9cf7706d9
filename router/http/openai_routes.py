"""The router's OpenAI surface: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(forwarded, :mod:`router.http.request_path`), ``POST /v1/responses`` and Anthropic's
``POST /v1/messages`` (routed as chat, :mod:`router.http.translated_routes`), ``GET /v1/models``,
and vLLM's ``POST /tokenize`` with the router's tokenizer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from starlette.types import ASGIApp

from httpapi.body import TOKENIZE_OFF_LOOP_BYTES, read_body
from openai_request.bodies import ApiError, parse_body
from router.http.client_quotas import ClientAccess, KeyCheck
from router.http.request_path import Forward
from router.http.state import RouterState
from router.http.tracing import Traced
from router.http.translated_routes import translated_routes

__all__ = ["add_openai_routes", "forwarding_routes"]


def forwarding_routes(state: RouterState) -> dict[str, ASGIApp]:
    """The two forwarding endpoints, as raw routes (:func:`httpapi.app.new_app`): FastAPI's
    middleware and routing cost more CPU per request than the routing decision, and buy nothing
    for a body forwarded as bytes."""
    routes: dict[str, ASGIApp] = {
        "/v1/completions": Forward(state, "completions", "/v1/completions"),
        "/v1/chat/completions": Forward(state, "chat", "/v1/chat/completions"),
        **translated_routes(state)}  # /v1/responses, /v1/messages
    if state.settings.api_keys is not None:  # client keys (router.http.client_quotas)
        routes = {path: KeyCheck(route, lambda: _access(state))
                  for path, route in routes.items()}
    if state.settings.tracing:  # a span per request (router.http.tracing)
        routes = {path: Traced(route, path, lambda: state.tracing)
                  for path, route in routes.items()}
    return routes


def _access(state: RouterState) -> ClientAccess:
    assert state.access is not None, "keys are configured: the lifespan made the check"
    return state.access


def add_openai_routes(app: FastAPI, state: RouterState) -> None:
    """Add ``/v1/models`` and ``/tokenize`` to ``app``, serving from ``state``."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's ``/tokenize``, with the router's tokenizer: the ids it routes on."""
        raw = await read_body(request, state.settings.max_body_bytes)
        body = parse_body(raw, state.settings.max_body_bytes)
        service = state.service
        max_len = service.shortest_model_len()
        try:
            if len(raw) > TOKENIZE_OFF_LOOP_BYTES:
                return await asyncio.to_thread(service.tokenize_answer, body, max_len)
            return service.tokenize_answer(body, max_len)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        if state.access is not None:
            state.access.identify(request.headers)
        now = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": now,
                                            "owned_by": "kvroute"}
                                           for m in state.service.models()]}
