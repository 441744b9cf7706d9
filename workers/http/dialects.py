"""The Responses API's and Anthropic's Messages API's answer shapes, whole and streamed, for the
bundled worker's ``POST /v1/responses`` and ``POST /v1/messages``.

Both run as a chat completion: the body is converted as the router routes it
(:mod:`openai_request.translated`), with its output limit (``max_output_tokens``,
``max_tokens``) and ``stream``; the answer is written in the endpoint's own shape. Text only:
no tools are called, nothing is stored (``store`` and ``previous_response_id`` are not
served), and errors keep the OpenAI shape.

A streamed Responses answer is the event sequence OpenAI's SDK reads (``response.created``,
``response.output_item.added``, ``response.content_part.added``, a
``response.output_text.delta`` per token, then the ``.done`` events and
``response.completed`` with the usage); a streamed Messages answer is Anthropic's
(``message_start``, ``content_block_start``, a ``content_block_delta`` per token,
``content_block_stop``, ``message_delta`` with the stop reason and usage, ``message_stop``).
Each event is ``event: TYPE`` and ``data: JSON`` lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from openai_request.translated import chat_of_messages, chat_of_responses

__all__ = ["DIALECTS", "Dialect", "MessagesReply", "ResponsesReply"]


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


@dataclass(slots=True)
class ResponsesReply:
    """One Responses API answer (the :class:`~workers.http.openai_format.Completion`
    interface)."""

    request_id: str
    model: str
    chat: bool
    created: int
    prompt_tokens: int
    cached_tokens: int = 0
    _text: list[str] = field(default_factory=list)
    _seq: int = 0

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        """The Responses API's ``usage``."""
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}]
        return {"id": f"msg_{self.request_id}", "type": "message", "status": status,
                "role": "assistant", "content": content if status == "completed" else []}

    def _response(self, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.request_id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": output, "usage": usage}

    def whole(self, text: str, finish_reason: str | None, completion_tokens: int
              ) -> dict[str, Any]:
        """The non-streaming answer."""
        status = "incomplete" if finish_reason == "length" else "completed"
        answer = self._response(status, [self._item(text, "completed")],
                                self.usage(completion_tokens))
        if finish_reason == "length":
            answer["incomplete_details"] = {"reason": "max_output_tokens"}
        return answer

    def _next(self, kind: str, payload: dict[str, Any]) -> bytes:
        self._seq += 1
        return _event(kind, {"sequence_number": self._seq - 1, **payload})

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False
              ) -> bytes:
        """One token's text; the first is preceded by the opening events."""
        head = b""
        item_id = f"msg_{self.request_id}"
        if first:
            head = (self._next("response.created",
                               {"response": self._response("in_progress", [])})
                    + self._next("response.output_item.added",
                                 {"output_index": 0, "item": self._item("", "in_progress")})
                    + self._next("response.content_part.added",
                                 {"item_id": item_id, "output_index": 0, "content_index": 0,
                                  "part": {"type": "output_text", "text": "",
                                           "annotations": []}}))
        self._text.append(text)
        return head + self._next("response.output_text.delta",
                                 {"item_id": item_id, "output_index": 0, "content_index": 0,
                                  "delta": text})

    def closing(self, completion_tokens: int, usage: bool) -> bytes:
        """The closing events, ``response.completed`` with the usage last."""
        text, item_id = "".join(self._text), f"msg_{self.request_id}"
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}
        item = self._item(text, "completed")
        return (self._next("response.output_text.done", {**at, "text": text})
                + self._next("response.content_part.done",
                             {**at, "part": item["content"][0]})
                + self._next("response.output_item.done", {"output_index": 0, "item": item})
                + self._next("response.completed",
                             {"response": self._response("completed", [item],
                                                         self.usage(completion_tokens))}))


_STOP = {"length": "max_tokens", "stop": "end_turn", None: "end_turn"}


@dataclass(slots=True)
class MessagesReply:
    """One Anthropic Messages API answer (the
    :class:`~workers.http.openai_format.Completion` interface)."""

    request_id: str
    model: str
    chat: bool
    created: int
    prompt_tokens: int
    cached_tokens: int = 0
    _reason: str | None = None

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        """Anthropic's ``usage``: input tokens not read from the cache, and those read."""
        return {"input_tokens": self.prompt_tokens - self.cached_tokens,
                "cache_read_input_tokens": self.cached_tokens,
                "output_tokens": completion_tokens}

    def _message(self, content: list[dict[str, Any]], stop: str | None,
                 completion_tokens: int) -> dict[str, Any]:
        return {"id": self.request_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": stop,
                "stop_sequence": None, "usage": self.usage(completion_tokens)}

    def whole(self, text: str, finish_reason: str | None, completion_tokens: int
              ) -> dict[str, Any]:
        """The non-streaming answer."""
        return self._message([{"type": "text", "text": text}],
                             _STOP.get(finish_reason, "end_turn"), completion_tokens)

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False
              ) -> bytes:
        """One token's text; the first is preceded by ``message_start`` and the block's."""
        head = b""
        if first:
            head = (_event("message_start", {"message": self._message([], None, 0)})
                    + _event("content_block_start",
                             {"index": 0, "content_block": {"type": "text", "text": ""}}))
        if finish_reason is not None:
            self._reason = finish_reason
        return head + _event("content_block_delta",
                             {"index": 0, "delta": {"type": "text_delta", "text": text}})

    def closing(self, completion_tokens: int, usage: bool) -> bytes:
        """``content_block_stop``, ``message_delta`` (stop reason, usage), ``message_stop``."""
        return (_event("content_block_stop", {"index": 0})
                + _event("message_delta",
                         {"delta": {"stop_reason": _STOP.get(self._reason, "end_turn"),
                                    "stop_sequence": None},
                          "usage": {"output_tokens": completion_tokens}})
                + _event("message_stop", {}))


class Dialect(NamedTuple):
    """An endpoint served as a chat completion: its body's conversion and its answer."""

    #: The chat body to run (raises ValueError for a body it cannot read).
    chat_body: Callable[[dict[str, Any]], dict[str, Any]]
    reply: type[ResponsesReply] | type[MessagesReply]
    #: The request id's prefix.
    prefix: str


def _responses_chat(body: dict[str, Any]) -> dict[str, Any]:
    return {**chat_of_responses(body), "max_tokens": body.get("max_output_tokens"),
            "stream": body.get("stream")}


def _messages_chat(body: dict[str, Any]) -> dict[str, Any]:
    return {**chat_of_messages(body), "max_tokens": body.get("max_tokens"),
            "stream": body.get("stream")}


#: The endpoints, by path.
DIALECTS = {"/v1/responses": Dialect(_responses_chat, ResponsesReply, "resp"),
            "/v1/messages": Dialect(_messages_chat, MessagesReply, "msg")}
