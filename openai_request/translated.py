"""OpenAI's Responses API (``POST /v1/responses``) and Anthropic's Messages API
(``POST /v1/messages``) bodies as the chat body the router routes them by.

A server that serves these endpoints renders them through the model's chat template, as it
does chat completions; vLLM converts both to a chat request first (its Responses API's
``construct_input_messages``, its Anthropic endpoint's ``to_chat_completion_request``). The
router routes such a request by the same conversion, so its prompt is tokenized and hashed
through the chat path (:mod:`openai_request.chat`, :mod:`openai_request.prompts`) and meets
the blocks chat requests and earlier turns left. The body forwarded is the client's, as
sent: the conversion only steers the choice, and a part it renders differently from the
engine costs a shorter match, never a wrong answer.

The conversion follows vLLM's for what routing reads:

- Responses: tokenized with ``add_special_tokens`` on, as vLLM (0.32) tokenizes its rendered
  prompt (its Responses requests set no such field, and its tokenizer's default adds them):
  with a template that writes the BOS token itself, the prompt starts with two, and shares
  no block with the same conversation sent as a chat completion. ``instructions`` is a
  system message; ``input`` is a user message when a string,
  else its items in order: a message item (``role`` and ``content``, a string or
  ``input_text``/``output_text``/``input_image`` parts; ``developer`` is routed as
  ``system``), a ``function_call`` (an assistant tool call, merged into the assistant message
  before it), a ``function_call_output`` (a tool message), ``reasoning`` (skipped, as the
  chat template does not render it).
- Messages: ``system`` (a string or text blocks; Claude Code's per-request
  ``x-anthropic-billing-header`` block skipped, as vLLM skips it) is one system message; each
  message's content is a string or blocks: ``text``, ``image`` (a base64 source as a data URL,
  a url source as is), ``tool_use`` (an assistant tool call), ``tool_result`` (a tool message,
  from a user), ``thinking`` and others skipped.

A Responses request naming ``previous_response_id`` or a ``conversation`` continues state
kept on the server that answered before; the router cannot see it and routes such a request
by its new input alone (docs/operations.md says where that matters).

Pure: a decoded body in, a chat body out.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["chat_of_messages", "chat_of_responses"]

#: Members passed on to the chat body the router routes by (model, the cache salt that
#: scopes block hashes, the flow-control priority).
_KEPT = ("model", "cache_salt", "priority")


def _kept(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in _KEPT if k in body}


def _text_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A Responses message's content as chat content (a string, or text and image parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{where}[{i}] must be an object")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]  # type: ignore[no-any-return]
    return parts


def chat_of_responses(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body a Responses API ``body`` is routed by (module docstring).

    Raises:
        ValueError: ``instructions`` or ``input`` of the wrong shape.
    """
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ValueError("instructions must be a string")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            _add_response_item(messages, item, f"input[{i}]")
    else:
        raise ValueError("input must be a string or a list of items")
    return {**_kept(body), "messages": messages, "add_special_tokens": True}


def _add_response_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object")
    kind = item.get("type", "message")
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else json.dumps(output)})
    elif kind == "message" and "role" in item:
        role = "system" if item["role"] == "developer" else item["role"]
        content = _text_parts(item.get("content"), f"{where}.content")
        if role == "assistant" and last is not None and last.get("content") is None:
            last["content"] = content
        else:
            messages.append({"role": role, "content": content})
    # reasoning and other items: not rendered by the chat template


def chat_of_messages(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body an Anthropic Messages API ``body`` is routed by (module docstring).

    Raises:
        ValueError: ``system`` or ``messages`` of the wrong shape.
    """
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str):
        if system:
            out.append({"role": "system", "content": system})
    elif isinstance(system, list):
        texts: list[str] = [b["text"] for b in system if isinstance(b, dict)
                            and b.get("type") == "text" and isinstance(b.get("text"), str)
                            and b["text"]
                            and not b["text"].startswith("x-anthropic-billing-header")]
        if texts:
            out.append({"role": "system", "content": "".join(texts)})
    elif system is not None:
        raise ValueError("system must be a string or a list of text blocks")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            _add_blocks(out, role, content, f"messages[{i}].content")
        else:
            raise ValueError(f"messages[{i}].content must be a string or a list of blocks")
    return {**_kept(body), "messages": out}


def _add_blocks(out: list[dict[str, Any]], role: Any, blocks: list[Any], where: str) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise ValueError(f"{where}[{j}] must be an object")
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            url = _image_url(block.get("source"))
            if url:
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name") or "",
                                       "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            if isinstance(result, list):
                result = "\n".join(r.get("text", "") for r in result
                                   if isinstance(r, dict) and r.get("type") == "text")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                        "content": result if isinstance(result, str) else ""})
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    message: dict[str, Any] = {"role": role}
    if calls:
        message["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        message["content"] = parts[0]["text"]
    elif parts:
        message["content"] = parts
    elif not calls:
        return  # nothing this message renders (only tool results, or thinking)
    else:
        message["content"] = None
    out.append(message)


def _image_url(source: Any) -> str | None:
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        return f"data:{source.get('media_type')};base64,{source.get('data')}"
    url = source.get("url")
    return url if isinstance(url, str) else None
