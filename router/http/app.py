"""The router's HTTP app: the shared preamble (:mod:`httpapi.app`) around one typed state
(:class:`router.http.state.RouterState`), with each surface in its own module:

- :mod:`router.http.openai_routes`: ``/v1/completions`` and ``/v1/chat/completions`` (raw
  ASGI routes ahead of FastAPI, :mod:`router.http.request_path`), ``/v1/models``, ``/tokenize``;
- :mod:`router.http.admin_routes`: ``/ready``, ``/workers`` and ``/debug/index/{id}``: the fleet;
- :mod:`router.http.debug_routes`: ``/debug/route``: a decision explained;
- :mod:`httpapi.app`: ``/health``, ``/metrics``, and how refusals are answered.

``/workers`` and ``/debug/*`` want the admin token when one is set: the debug endpoints tell
which prefixes are cached where.
"""

from __future__ import annotations

from fastapi import FastAPI

from httpapi.app import new_app
from router.http.admin_routes import add_admin_routes
from router.http.debug_routes import add_debug_routes
from router.http.openai_routes import add_openai_routes, forwarding_routes
from router.http.state import RouterState
from router.settings import RouterSettings

__all__ = ["create_app"]


def create_app(settings: RouterSettings) -> FastAPI:
    """Build the router app; its lifespan starts and stops every background part."""
    state = RouterState(settings)
    app = new_app("kvroute router", state, forwarding_routes(state))
    add_openai_routes(app, state)
    add_debug_routes(app, state)
    add_admin_routes(app, state)
    return app
