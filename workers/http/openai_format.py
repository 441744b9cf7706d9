"""OpenAI response shapes for completions and chat, whole and streamed (SSE)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Completion", "sse"]


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


@dataclass(slots=True)
class Completion:
    """Builds the answers of one request, in the dialect of its endpoint."""

    request_id: str
    model: str
    chat: bool
    created: int
    prompt_tokens: int
    cached_tokens: int = 0

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        """The ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def whole(self, text: str, finish_reason: str | None, completion_tokens: int
              ) -> dict[str, Any]:
        """The non-streaming answer."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason}
        return {**self._head(), "choices": [choice], "usage": self.usage(completion_tokens)}

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False
              ) -> bytes:
        """One streamed piece of text (the first chat chunk carries the role)."""
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason}
        return sse({**self._head(stream=True), "choices": [choice]})

    def usage_chunk(self, completion_tokens: int) -> bytes:
        """The final ``stream_options.include_usage`` chunk: no choices, the usage."""
        return sse({**self._head(stream=True), "choices": [],
                    "usage": self.usage(completion_tokens)})

    def closing(self, completion_tokens: int, usage: bool) -> bytes:
        """A stream's end: the usage chunk when asked for, then ``[DONE]``."""
        return (self.usage_chunk(completion_tokens) if usage else b"") + sse("[DONE]")

    def _head(self, *, stream: bool = False) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model}
