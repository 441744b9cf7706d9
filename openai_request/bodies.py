"""The OpenAI-style API protocol shared by worker and router: request bodies, their schema, and
errors.

One shape for every refusal either app gives a client, and one schema for the two request
bodies, checked the same way on both sides. Pure (no web framework, no I/O): the HTTP apps
(:mod:`httpapi`) read the bytes and turn :func:`error_body` into their JSON responses.

Notes:
    1. :func:`validate_request` checks the types and ranges of the fields OpenAI defines
       (``temperature`` in [0, 2], ``stream`` a boolean, ...) and names the offending one in
       :attr:`ApiError.param`. Fields it does not know are left alone: the router forwards the
       body's bytes unchanged and the engine may read them.
    2. How the prompt's content becomes tokens (roles, image parts, token-id ranges) is
       :func:`openai_request.prompts.build_prompt`'s business; the schema only checks its shape.
    3. A body nested deeper than the decoder's recursion limit is a 400, not a crash.
    5. A JSON object anywhere in the body that repeats a key is a 400 naming the key. Two
       readers of a repeated key may take different values: msgspec and vLLM's
       ``json.loads`` take the last, other parsers the first, and the router's early reader
       (:mod:`openai_request.stream_json`), which decides before the body ends, the first it
       sees; the router would route, book and check one value while the engine serves
       another. Reading as every engine reads is not possible, so neither is taken. msgspec
       keeps no repeated key to count, so the check is a proof by counting
       (:func:`_no_repeats`): every colon outside a string separates one member of an
       object, so the body's colons less those inside its decoded strings are its members,
       and when they equal the keys the decoded objects hold, none was lost to a repeat.
       Where that cannot be told cheaply (an escaped colon, a body of many values or deep
       nesting) or the counts differ, a second decode by :func:`json.loads` with a pairs
       hook finds the key (about twice msgspec's time). A parse of a 5 KB chat body costs
       about as much as msgspec's decode alone (``python -m bench.parse_body``).
    4. :func:`fewest_prompt_tokens` tells from a completions prompt's length alone, without
       encoding it, how many tokens it needs at least, so that a prompt far over the model's
       length is refused before any time goes into encoding it. A chat body gets no such
       bound: its template decides how much of each message reaches the prompt.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

__all__ = ["MAX_BODY_BYTES", "ApiError", "ChatRequest", "CompletionRequest", "StreamOptions",
           "error_body", "fewest_prompt_tokens", "parse_body", "validate_request"]

MAX_BODY_BYTES = 64 * 1024 * 1024


class ApiError(Exception):
    """A request refused, with the HTTP status and OpenAI error type to send."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code


def error_body(error: ApiError) -> dict[str, Any]:
    """The JSON body OpenAI clients parse: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": error.message, "type": error.kind, "param": error.param,
                      "code": error.code or error.status}}


def parse_body(raw: bytes, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """Decode a request body that must be a JSON object.

    Raises:
        ApiError: 413 when over ``max_bytes``; 400 when not JSON, not an object, nested
            too deeply to decode, or an object in it repeats a key (module note 5).
    """
    if len(raw) > max_bytes:
        raise ApiError(413, f"the request body is over {max_bytes} bytes")
    try:
        body = msgspec.json.decode(raw)
        if type(body) is dict and not _no_repeats(raw, body):
            json.loads(raw, object_pairs_hook=_unique)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None
    except _RepeatedKey as exc:
        raise ApiError(400, f"the key {exc.key!r} is repeated in a JSON object of the body; "
                       "each key may appear once", param=exc.key) from None
    except ValueError as exc:  # what json.loads alone refuses (an integer of 4300 digits)
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if type(body) is not dict:
        raise ApiError(400, "the body must be a JSON object")
    return body


#: Values :func:`_no_repeats` visits at most; past it (a long list of token ids, deep
#: nesting) the pairs hook checks instead. It also bounds the depth the proof accepts far
#: below the decoders' recursion limits, so a body too deep for :func:`json.loads` is
#: still refused as before.
_PROOF_VALUES = 512


def _no_repeats(raw: bytes, body: dict[str, Any]) -> bool:
    """Whether counting proves that no object in ``raw`` (decoded as ``body``) repeats a
    key; ``False`` when it cannot tell (module note 5).

    In valid JSON a colon outside a string separates exactly one member of an object, and a
    colon byte inside a string decodes to one colon of that string, unless written as an
    escape (``\\u003a``), which the proof declines. So the colons of ``raw`` less the
    colons of the decoded strings are at least the members written, and the members
    written are at least the keys decoded, the same only when no key repeated (a repeat's
    member, and its strings' colons, are dropped in decoding). Both equal: no repeat. A body
    with no colon in its strings has as many colons as keys, and needs no more.
    """
    keys = 0
    texts: list[str] = []
    budget = _PROOF_VALUES
    stack: list[Any] = [body]
    while stack:
        value = stack.pop()
        budget -= len(value)
        if budget < 0:
            return False
        if type(value) is dict:
            keys += len(value)
            texts += value  # the keys
            value = value.values()
        for item in value:
            kind = type(item)
            if kind is str:
                texts.append(item)
            elif kind is dict or kind is list:
                stack.append(item)
    written = raw.count(b":")
    if written == keys:
        return True
    if b"\\" in raw and b"\\u003" in raw:  # a colon may be escaped (memchr first: fast)
        return False
    for text in texts:
        written -= text.count(":")
    return written == keys


class _RepeatedKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> None:
    """``json.loads``'s pairs hook: raise at the first repeated key (the objects
    themselves are not needed: msgspec's decode is the body)."""
    if len({key for key, _ in pairs}) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)


PositiveInt = Annotated[int, Meta(ge=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: what a streamed answer reports besides the text."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """The fields both endpoints share (OpenAI's types and ranges; ``null`` is "not given")."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    seed: int | None = None
    user: str | None = None
    cache_salt: Annotated[str, Meta(min_length=1)] | None = None

    @property
    def output_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else ``None``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling, kw_only=True):
    """The body of ``POST /v1/completions``."""

    # One array-like type per union (msgspec's rule): the shape of a list prompt (strings,
    # token ids or lists of them) is build_prompt's to check.
    prompt: str | list[str | int | list[int]]
    echo: bool | None = None
    best_of: Annotated[int, Meta(ge=0, le=20)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    suffix: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    """The body of ``POST /v1/chat/completions``."""

    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    parallel_tool_calls: bool | None = None


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def validate_request(body: dict[str, Any], kind: Literal["completions", "chat"]
                     ) -> CompletionRequest | ChatRequest:
    """Check a decoded body against the endpoint's schema (module notes 1 and 2).

    Args:
        body: the decoded JSON object.
        kind: which endpoint it came to.

    Returns:
        The body's known fields, typed.

    Raises:
        ApiError: 400 naming the first field of the wrong type or out of range.
    """
    schema: type[CompletionRequest | ChatRequest] = (
        ChatRequest if kind == "chat" else CompletionRequest)
    try:
        return msgspec.convert(body, schema)
    except msgspec.ValidationError as exc:
        reason = str(exc)
        at, missing = _AT.search(reason), _MISSING.search(reason)
        param = at.group(1) if at else missing.group(1) if missing else None
        message = reason[:at.start()] if at else reason
        raise ApiError(400, f"invalid '{param}': {message}" if param else message,
                       param=param) from None


def fewest_prompt_tokens(request: CompletionRequest | ChatRequest,
                         max_bytes_per_token: int | None) -> int:
    """The fewest tokens the request's prompt can encode to, known without encoding it
    (module note 4); 0 when nothing is known.

    Args:
        request: the validated body.
        max_bytes_per_token: the tokenizer's bound
            (:attr:`openai_request.tokenizer.Tokenizer.max_bytes_per_token`), ``None`` if unbounded.
    """
    if not isinstance(request, CompletionRequest):
        return 0
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # type: ignore[assignment]
    if isinstance(prompt, str):
        # Each character is at least one byte, each token at most max_bytes_per_token bytes.
        return -(-len(prompt) // max_bytes_per_token) if max_bytes_per_token else 0
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return len(prompt)  # token ids, taken as they are
    return 0
