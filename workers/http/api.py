"""The worker's HTTP app, in front of one engine: the shared preamble (:mod:`httpapi.app`)
around one typed state (:class:`workers.http.state.WorkerState`), with each surface in its own
module:

- :mod:`workers.http.openai_routes`: ``/v1/completions``, ``/v1/chat/completions`` (streaming or
  not), ``/v1/models``;
- :mod:`workers.http.control_routes`: ``/model_info``, ``/load``, behind the KV transfer
  secret (or loopback) the ``/kv_transfer/*`` endpoints peers read KV from, and behind the
  admin token ``/reset_prefix_cache``, ``/kv/snapshot``, ``/debug/drop_events``;
- :mod:`workers.http.vllm_compat`: ``/tokenize`` and the other endpoints peer routers read;
- :mod:`httpapi.app`: ``/health``, ``/metrics``, and how refusals are answered and counted;
- :mod:`workers.http.tracing`: with tracing on, a span around each generation request.
"""

from __future__ import annotations

from fastapi import FastAPI

from httpapi.app import new_app
from workers.http.control_routes import add_control_routes
from workers.http.openai_routes import add_openai_routes
from workers.http.state import WorkerState
from workers.http.tracing import TracedRequests
from workers.http.vllm_compat import register_vllm_compat
from workers.settings import WorkerSettings

__all__ = ["create_app"]


def create_app(settings: WorkerSettings) -> FastAPI:
    """Build the worker app; its lifespan starts the engine and the event publisher."""
    state = WorkerState(settings)
    app = new_app("kvroute worker", state)
    register_vllm_compat(app, state.runtime)  # /tokenize, render, /server_info: for peer routers
    add_openai_routes(app, state)
    add_control_routes(app, state)
    if settings.tracing:
        app.add_middleware(TracedRequests, tracing=lambda: state.tracing)
    return app
