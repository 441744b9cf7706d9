"""vLLM's tokenizer endpoints, answered from a :class:`~openai_request.tokenizer.Tokenizer`.

Other routers tokenize through the engine before routing on cache: vllm-router asks
``POST /v1/completions/render`` (then ``POST /tokenize``), llm-d's endpoint picker the render
endpoints. Answering them as vLLM's OpenAI server does lets those routers' cache-aware
policies work in front of kvroute's worker, and lets anyone check that the kvroute router
tokenizes exactly as the engine.

Request and answer shapes (vLLM ``entrypoints/openai``):

- ``POST /tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "add_special_tokens": false}``, optionally
  ``"return_token_strs": true``; answers ``{"count", "max_model_len", "tokens",
  "token_strs"}``.
- ``POST /detokenize``: ``{"tokens": [int]}``; answers ``{"prompt": str}``.
- ``POST /v1/completions/render``: a completions body; answers a list with one
  ``{"request_id", "token_ids", "sampling_params", "model"}`` per prompt.
- ``POST /v1/chat/completions/render``: a chat body; answers one such object.

Special tokens as vLLM handles them: a completions prompt gets them (the tokenizer's
post-processor writes BOS), a chat prompt does not (its template writes its own), and either
default can be overridden with ``add_special_tokens``. Pure functions: the HTTP shells are
:mod:`workers.http.vllm_compat` and the router's app.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from openai_request.prompts import build_prompt
from openai_request.tokenizer import Tokenizer

__all__ = ["detokenize", "prompt_ids", "render", "tokenize"]


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if type(value) is not bool:
        raise ValueError(f"{name} must be a boolean")
    return value


def prompt_ids(body: Any, tokenizer: Tokenizer) -> list[int]:
    """The token ids of a completions or chat body: the ids the router routes on and the
    worker prefills (:func:`openai_request.prompts.build_prompt`; image parts count one position).

    Raises:
        ValueError: the body is malformed (the message is the API error reason).
    """
    if type(body) is not dict:
        raise ValueError("request body must be a JSON object")
    if "messages" not in body and "prompt" not in body:
        raise ValueError("give a prompt or messages")
    kind: Literal["completions", "chat"] = "chat" if "messages" in body else "completions"
    return build_prompt(body, kind, tokenizer, mm_tokens_per_image=1, max_image_bytes=1,
                        fetch=None).token_ids


def tokenize(body: Any, tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """Answer ``POST /tokenize`` (module docstring).

    Raises:
        ValueError: the body is malformed.
    """
    ids = prompt_ids(body, tokenizer)
    strs = None
    if _flag(body, "return_token_strs", False):
        strs = [tokenizer.decode([i]) for i in ids]
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize(body: Any, tokenizer: Tokenizer) -> dict[str, Any]:
    """Answer ``POST /detokenize`` (module docstring).

    Raises:
        ValueError: the body is malformed or a token is outside the vocabulary.
    """
    tokens = body.get("tokens") if type(body) is dict else None
    if type(tokens) is not list or not all(type(t) is int for t in tokens):
        raise ValueError("tokens must be a list of token ids")
    return {"prompt": tokenizer.decode(tokens)}


def render(body: Any, tokenizer: Tokenizer, model: str, *, chat: bool) -> Any:
    """Answer the completions or chat render endpoint (module docstring).

    Raises:
        ValueError: the body is malformed.
    """
    if type(body) is not dict:
        raise ValueError("request body must be a JSON object")
    if chat != ("messages" in body):
        raise ValueError("messages is required" if chat else "prompt is required")
    ids = prompt_ids(body, tokenizer)
    sampling = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop")
                if body.get(k) is not None}
    answer = {"request_id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
              "token_ids": ids, "sampling_params": sampling,
              "model": body.get("model") or model}
    return answer if chat else [answer]
