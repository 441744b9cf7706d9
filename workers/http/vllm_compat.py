"""vLLM- and SGLang-compatible endpoints of the worker, for other routers in front of it.

vllm-router tokenizes text prompts through the worker (``POST /v1/completions/render``, then
``POST /tokenize``) before its cache-aware policies can work, and falls back to load balancing
when they answer 404; sglang-router reads ``/server_info`` or ``/get_server_info`` (and
``model_path`` in ``/model_info``) to learn which model a worker serves. These answer them:

- ``POST /tokenize``, ``POST /detokenize``, ``POST /v1/completions/render``,
  ``POST /v1/chat/completions/render``: vLLM's shapes (:mod:`openai_request.tokenize_api`), with the
  worker's own tokenizer, so they give exactly the ids the worker prefills.
- ``GET /server_info`` and ``GET /get_server_info``: the serving arguments peers read
  (``model_path``, ``tokenizer_path``, ``served_model_name``, ``page_size``, ``dp_size``,
  ``max_total_num_tokens``, ``max_model_len``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from openai_request import tokenize_api
from openai_request.bodies import ApiError, parse_body
from workers.runtime import WorkerRuntime

__all__ = ["register_vllm_compat"]


def register_vllm_compat(app: FastAPI, runtime: WorkerRuntime) -> None:
    """Add the endpoints (module docstring) to the worker's ``app``."""
    settings = runtime.settings

    def check_model(body: Any) -> None:
        model = body.get("model") if type(body) is dict else None
        if model is not None and model != settings.model and runtime.lora_scope(model) is None:
            raise ApiError(404, f"the model {model!r} does not exist", param="model",
                           code="model_not_found")

    async def body_of(request: Request) -> dict[str, Any]:
        body = parse_body(await request.body())
        check_model(body)
        return body

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        try:
            return tokenize_api.tokenize(body, runtime.tokenizer, settings.max_model_len)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        try:
            return tokenize_api.detokenize(body, runtime.tokenizer)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tokens") from None

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> Any:
        body = await body_of(request)
        try:
            return tokenize_api.render(body, runtime.tokenizer, settings.model, chat=False)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> Any:
        body = await body_of(request)
        try:
            return tokenize_api.render(body, runtime.tokenizer, settings.model, chat=True)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    def server_info() -> dict[str, Any]:
        info = runtime.model_info()
        return {"model_path": settings.model, "tokenizer_path": settings.tokenizer or "",
                "served_model_name": settings.model, "page_size": settings.block_size,
                "dp_size": 1, "max_total_num_tokens":
                    info["capacity"]["num_blocks"] * settings.block_size,
                "max_model_len": settings.max_model_len,
                "kv_events_endpoint": info["events_endpoint"]}

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)
