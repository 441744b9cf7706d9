"""The preamble both apps build the same way: the FastAPI object, its lifespan, how a refusal
and a client that left are answered, the admin check, ``/health`` and ``/metrics``.

Each app keeps its state in one typed object that satisfies :class:`AppState` (the router's
:class:`router.http.state.RouterState`, the worker's :class:`workers.http.state.WorkerState`);
:func:`new_app` wires that object into a FastAPI app, and the app's route modules add their
surfaces to it, each handler reading the state object it was given.

Rules:
    1. An :class:`~openai_request.bodies.ApiError` raised anywhere in a handler becomes the
       OpenAI-style JSON error (:func:`httpapi.responses.error_response`), after the state has
       been told of the refusal (:meth:`AppState.refused`).
    2. A client that leaves while its body is read (:class:`~httpapi.body.ClientGone`) is
       counted and answered with :data:`~httpapi.responses.CLIENT_GONE_STATUS`, no traceback.
    3. ``GET /health`` answers as long as the process serves; readiness is each app's own.
    4. No API description is served (:data:`httpapi.auth.NO_API_DOCS`).
    5. A raw route (a plain ASGI app for one ``POST`` path, given to :func:`new_app`) is
       answered ahead of FastAPI: no middleware, no routing table, no request object. Rules
       1 and 2 still hold for it; everything else (headers, streaming, a client that leaves
       mid-answer) is its own business. Other methods on its path go to FastAPI, which
       answers 405. Middleware added to the FastAPI app never sees a raw route: what must
       see every request wraps the app given to the server (as :mod:`httpapi.server` does
       with the body deadline). The router serves its two forwarding endpoints this way: FastAPI's
       middleware stack cost more CPU per request than the routing decision
       (``docs/benchmarks.md`` has the figures). The server (:mod:`httpapi.server` rule 7)
       serves a raw route itself, with neither the app nor the middleware around it
       (:meth:`raw_routes`, :mod:`httpapi.lean_cycle`): what a raw route sees is the same.
    6. Every HTTP request, raw routes included, gets a request id (:class:`httpapi.logs.RequestIds`)
       that every line logged while it is handled names.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from httpapi.auth import NO_API_DOCS, check_bearer
from httpapi.body import ClientGone
from httpapi.logs import RequestIds
from httpapi.responses import CLIENT_GONE_STATUS, error_response
from openai_request.bodies import ApiError

__all__ = ["ADMIN_BODY_BYTES", "Admin", "AppState", "new_app"]

#: Bodies of the admin endpoints are small: a URL, a number or nothing.
ADMIN_BODY_BYTES = 64 * 1024


class AppState(Protocol):
    """What :func:`new_app` needs from an app's state object."""

    def lifespan(self, app: FastAPI) -> AbstractAsyncContextManager[None]:
        """Start every background part, and stop them when the context ends."""

    def refused(self, error: ApiError) -> None:
        """Note a request refused with ``error`` (rule 1)."""

    def client_gone(self, stage: str) -> None:
        """Count a client that left before its answer, at ``stage``
        (:data:`~httpapi.responses.DISCONNECT_STAGES`)."""

    def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""


class Admin:
    """The admin check of :mod:`httpapi.auth` (rule 1) for one token; each admin handler calls
    it with its request first.

    Args:
        token: the admin token, or ``None`` for open admin endpoints.
    """

    __slots__ = ("token",)

    def __init__(self, token: str | None) -> None:
        self.token = token

    def __call__(self, request: Request) -> None:
        """Raises: ApiError: 401 when the request does not carry the token."""
        check_bearer(request.headers.get("authorization"), self.token)


class _App(FastAPI):
    """FastAPI, with raw routes answered ahead of it (rule 5)."""

    def __init__(self, state: AppState, raw: Mapping[str, ASGIApp], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._state = state
        self._raw = dict(raw)
        self._with_ids = RequestIds(self._dispatch)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._with_ids(scope, receive, send)

    @property
    def request_ids(self) -> RequestIds:
        """Names every request (rule 6)."""
        return self._with_ids

    def raw_routes(self) -> dict[bytes, ASGIApp]:
        """Rule 5's raw routes by path, each answering rules 1 and 2 itself, for a server that
        serves them without this app (:mod:`httpapi.lean_cycle`), naming each request with
        :attr:`request_ids` as it does."""
        return {path.encode("ascii"): functools.partial(self._answer_raw, route)
                for path, route in self._raw.items()}

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self._raw.get(scope["path"])
            if route is not None:
                await self._answer_raw(route, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _answer_raw(self, route: ASGIApp, scope: Scope, receive: Receive, send: Send
                          ) -> None:
        try:
            await route(scope, receive, send)
        except ApiError as exc:
            self._state.refused(exc)
            await error_response(exc)(scope, receive, send)
        except ClientGone:
            self._state.client_gone("body")
            await Response(status_code=CLIENT_GONE_STATUS)(scope, receive, send)


def new_app(title: str, state: AppState, raw: Mapping[str, ASGIApp] | None = None
            ) -> FastAPI:
    """The FastAPI app for ``state``: its lifespan, rules 1-5 and ``/metrics``; the caller adds
    its surfaces.

    Args:
        title: the app's name.
        state: the app's state.
        raw: ASGI apps answering ``POST`` on their paths ahead of FastAPI (rule 5).
    """
    raw = raw or {}
    app = _App(state, raw, title=title, lifespan=state.lifespan, **NO_API_DOCS)
    for path, route in raw.items():  # so that FastAPI answers the other methods with 405
        app.router.routes.append(Route(path, route, methods=["POST"], include_in_schema=False))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        state.refused(exc)
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        state.client_gone("body")
        return Response(status_code=CLIENT_GONE_STATUS)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_page() -> Response:
        body, content_type = state.render_metrics()
        return Response(body, media_type=content_type)

    return app
