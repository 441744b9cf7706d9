"""When a request body that arrives in pieces may be decided before its end, and on what.

The body arrives in chunks (from Envoy under ``FULL_DUPLEX_STREAMED``, or from the client
on the router's own HTTP path) that an :class:`EarlyBody` reads with
:class:`~openai_request.stream_json.ObjectReader`. Once the body's ``model`` is known and
its prompt (``prompt`` for completions, ``messages`` for chat) is being read, it offers the
body as far as it has arrived, at doubling sizes (from :data:`FIRST_TRY_BYTES` up to
:data:`LAST_TRY_BYTES`), for the router to try (``RouterService.settles``): with
``--tokenize match`` the router tokenizes a prompt only as far as some worker holds it, so
once the match ends inside what arrived the decision is settled. The tail still to come is
stood in for by as many characters as the body has bytes left by its ``content-length``
(none when it sends none), so the load booked counts the whole prompt.

Only what the decision reads before the prompt counts. A body whose ``model`` comes after its
prompt (OpenAI's SDKs write ``messages`` first) is tried as if it named the router's only
model when the router serves one model name and no adapter (``only_model``: the model then
picks no worker, no tokenizer and no hash scope the router does not already know); elsewhere
it is decided at its end, as is a body whose prompt is a list of token ids or whose last
message's content is not a string. Members after the prompt that would have changed the
choice (``cache_salt``, ``tools``, chat template arguments, a ``priority`` for flow control)
are not seen by an early decision: a client that needs them to steer routing writes them
before the prompt (or sends the priority as a header). A reader error (not a JSON object)
also leaves the body to its end, where the buffered path's parse gives the client its error.
A body decided early that turns out invalid past the decision (cut short, say, or naming a
model the router does not serve) has been sent on: the worker refuses it, as it would any
invalid body.
"""

from __future__ import annotations

from typing import Any

from openai_request.bodies import MAX_BODY_BYTES
from openai_request.stream_json import ObjectReader, StreamError

__all__ = ["FIRST_TRY_BYTES", "LAST_TRY_BYTES", "EarlyBody"]

#: The body bytes read before the first try; each later try waits for twice as many.
FIRST_TRY_BYTES = 8192
#: No try once more than this has arrived: a try decides on all that arrived (a walk of
#: about 14 µs a KB when its segments are cached), and a prompt held further than this (a
#: repeat, a long shared document) would pay it at every doubling for nothing: 9-12 ms of
#: CPU on a repeated 600 KB body, against at most about 2 ms for the tries up to here.
LAST_TRY_BYTES = 64 * 1024
#: The stand-in for the bytes still to come: words of one letter, so the tokenizer's cutter
#: finds a cut every few characters (a run without spaces as long as the tail cost a 100 KB
#: body's decision 3.9 ms of CPU against 0.5 ms for this).
_FILL = " x"


class EarlyBody:
    """One streamed body's reader and its early tries.

    Args:
        kind: ``"chat"`` or ``"completions"`` (the path's), or ``None`` when unknown.
        content_length: the body's length by its header, or ``None``.
        only_model: the router's one model name, when it serves one (module docstring): a
            body that has not named its model by the prompt is tried with this one.
    """

    def __init__(self, kind: str | None, content_length: int | None,
                 only_model: str | None = None) -> None:
        self._prompt_key = {"chat": "messages", "completions": "prompt"}.get(kind or "")
        self._length = content_length
        self._only_model = only_model
        self._reader: ObjectReader | None = ObjectReader() if self._prompt_key else None
        self._next_try = FIRST_TRY_BYTES

    def feed(self, chunk: bytes) -> tuple[Any, Any] | None:
        """Read ``chunk``; the ``(partial, padded)`` bodies to try now, or ``None``."""
        reader, key = self._reader, self._prompt_key
        if reader is None or key is None:
            return None
        if reader.fed + len(chunk) > LAST_TRY_BYTES:
            self._reader = None  # decided at the body's end; the rest is not read
            return None
        try:
            reader.feed(chunk)
        except StreamError:
            self._reader = None
            return None
        named = "model" in reader.members
        if (reader.fed < self._next_try or reader.open_key != key
                or not (named or self._only_model is not None)):
            return None
        self._next_try = reader.fed * 2
        try:
            partial = reader.partial()
        except StreamError:
            self._reader = None
            return None
        if not named:
            partial = {**partial, "model": self._only_model}
        # A declared length is the client's word: the stand-in never passes the body limit.
        rest = (min(max(0, self._length - reader.fed), MAX_BODY_BYTES)
                if self._length is not None else 0)
        padded = _padded(partial, key, rest)
        return None if padded is None else (partial, padded)

    def stop(self) -> None:
        """No more tries (decided, or refused): later chunks are not read."""
        self._reader = None


def _padded(partial: dict[str, Any], key: str, rest: int) -> dict[str, Any] | None:
    prompt = partial.get(key)
    if key == "prompt":
        return {**partial, key: prompt + _fill(rest)} if isinstance(prompt, str) else None
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[-1], dict):
        return None
    last = prompt[-1]
    if not isinstance(last.get("role"), str) or not isinstance(last.get("content"), str):
        return None
    return {**partial, key: [*prompt[:-1], {**last, "content": last["content"] + _fill(rest)}]}


def _fill(size: int) -> str:
    """``size`` characters (and bytes) of stand-in text."""
    return _FILL * (size // len(_FILL)) + _FILL[-1] * (size % len(_FILL))
