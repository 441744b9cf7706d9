"""An OpenAI completions or chat request body, turned into token ids and image spans.

The router and the workers both call :func:`build_prompt` on the same body with the same
tokenizer (equal :attr:`~openai_request.tokenizer.Tokenizer.identity`), so they agree on every token
id, which is what makes the router's prefix lookups hit. The one thing they may not share is
the bytes of a remote image: the worker fetches ``http(s)`` images (its ``fetch`` returns the
bytes) and the router does not (its ``fetch`` returns ``None``). Such an image gets no digest,
and the router's lookup stops at it (:meth:`PromptTokens.matchable_tokens`).

Rules:
    1. Completions: ``prompt`` is a string (encoded with the tokenizer's special tokens, as
       vLLM does), a list of token ids (taken as is), or a list holding one of those. Several
       prompts in one request are refused.
    2. Chat: ``messages`` are rendered with the tokenizer's chat template
       (:func:`openai_request.chat.render_chat`), the text is split at each image marker, each piece
       is encoded without special tokens, and each image takes ``mm_tokens_per_image``
       positions holding the tokenizer's ``image_token_id``. Images are numbered in the order
       of their parts; a template is trusted to render messages in order, and one that drops
       or repeats a message's content is refused (its image markers do not add up).
    3. Image UUIDs come from each part (``uuid``, or ``image_url.uuid``) and/or from the body's
       ``mm_uuids``: a list with one entry (string or ``null``) per image, or
       ``{"image": [...]}``. Both may be given when they agree.
    4. Every ``ValueError`` is a caller mistake worded for an HTTP 400 reply.
    5. Given a :data:`Reach` and a tokenizer that walks (:class:`~openai_request.segment_cache.
       SegmentedTokenizer`), a text prompt without images is encoded in doubling steps of
       :data:`FIRST_STEP_CHARS` characters and stops once the reach wants no more; the rest
       is then estimated (:attr:`PromptTokens.estimated_tokens`). It also stops once it has
       had to tokenize :data:`WALK_ENCODE_LIMIT_CHARS` characters the cache did not hold,
       which bounds the time one request holds the router's event loop to what a 256 KB
       body took before walks (a prompt held further than that by the workers but new to
       this router, say after a restart, is then matched only that far). The router does
       this; a worker, which serves the prompt, never does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from openai_request.chat import ImageRef, render_chat_with_images
from openai_request.images import (
    IMAGE_MARKER,
    ImageSpan,
    decode_data_url,
    image_digest,
    splice_images,
)
from openai_request.tokenizer import Tokenizer

__all__ = ["FIRST_STEP_CHARS", "WALK_ENCODE_LIMIT_CHARS", "Fetch", "PromptTokens", "Reach",
           "build_prompt"]

#: Returns a remote image's bytes, or ``None`` when the caller cannot or will not fetch it.
Fetch = Callable[[str], bytes | None]
#: Called with the ids known so far and the request's cache salt: whether more are wanted.
Reach = Callable[[list[int], "str | None"], bool]
#: The characters a walking encode takes first (rule 5); each further step doubles.
FIRST_STEP_CHARS = 4096
#: The most characters a walking encode tokenizes that the cache did not hold (rule 5).
WALK_ENCODE_LIMIT_CHARS = 256 * 1024


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A request's prompt as token ids, with what identifies its images and its reuse scope.

    Attributes:
        token_ids: the prompt; image positions hold the tokenizer's ``image_token_id``.
        images: the images in position order, non-overlapping, each inside ``token_ids``.
        cache_salt: the request's ``cache_salt``; requests with different salts never share KV.
        model: the requested model name (a LoRA adapter's name selects that adapter).
        estimated_tokens: tokens after ``token_ids`` that were not encoded, estimated from
            their bytes (rule 5); 0 when ``token_ids`` is the whole prompt.
    """

    token_ids: list[int]
    images: list[ImageSpan] = field(default_factory=list)
    cache_salt: str | None = None
    model: str | None = None
    estimated_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """The prompt's length: the ids known plus the estimate of the rest."""
        return len(self.token_ids) + self.estimated_tokens

    def matchable_tokens(self, *, by_uuid: bool = False) -> int:
        """Return how many leading positions can be hashed for a prefix lookup.

        That is all of them, unless an image has no digest: the prefix then ends where that
        image starts.

        Args:
            by_uuid: an image without a digest but with a UUID counts as identified (for a
                worker that advertised UUID routing).
        """
        for span in self.images:
            if span.digest is None and not (by_uuid and span.uuid is not None):
                return span.start
        return len(self.token_ids)


def build_prompt(
    body: Any,
    kind: Literal["completions", "chat"],
    tokenizer: Tokenizer,
    *,
    mm_tokens_per_image: int,
    max_image_bytes: int,
    fetch: Fetch | None,
    check_token_ids: bool = True,
    reach: Reach | None = None,
) -> PromptTokens:
    """Turn a request body into its prompt tokens (rules in the module docstring).

    Args:
        body: the decoded JSON body of ``/v1/completions`` or ``/v1/chat/completions``.
        kind: which endpoint the body came to.
        tokenizer: the tokenizer shared by router and workers.
        mm_tokens_per_image: positions each image occupies (at least 1).
        max_image_bytes: largest accepted image, inline or fetched (at least 1).
        fetch: called with each ``http(s)`` image URL; ``None`` fetches nothing (those images
            get no digest).
        check_token_ids: validate a token-id prompt against the vocabulary. The router turns
            this off: it only hashes the ids (the hash refuses anything but ints) and the
            worker, which must validate, answers a bad id with the reason; an 8k-token check
            costs the router ~60 µs of its decision.
        reach: encode a text prompt only as far as this wants (rule 5).

    Returns:
        The prompt tokens.

    Raises:
        ValueError: the body is malformed (the message is an API error reason), or
            ``kind``, ``mm_tokens_per_image`` or ``max_image_bytes`` is invalid.
    """
    if kind not in ("completions", "chat"):
        raise ValueError(f"kind must be 'completions' or 'chat', got {kind!r}")
    if mm_tokens_per_image < 1:
        raise ValueError(f"mm_tokens_per_image must be at least 1, got {mm_tokens_per_image}")
    if max_image_bytes < 1:
        raise ValueError(f"max_image_bytes must be at least 1, got {max_image_bytes}")
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("model must be a string")
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt must be a non-empty string")

    walker = _Walker(tokenizer, reach, cache_salt) if reach is not None else None
    if kind == "completions":
        token_ids = _completion_ids(body, tokenizer, check_token_ids, walker)
        if "mm_uuids" not in body:  # the common case, kept short: a router decides on it
            rest = walker.estimated if walker is not None else 0
            return PromptTokens(token_ids, [], cache_salt, model, rest)
        refs: list[ImageRef] = []
        starts: list[int] = []
    else:
        token_ids, refs, starts = _chat_ids(body, tokenizer, mm_tokens_per_image, walker)
        if not refs and walker is not None and walker.estimated:
            return PromptTokens(token_ids, [], cache_salt, model, walker.estimated)
    uuids = _merge_uuids(refs, body.get("mm_uuids"))
    images = [
        ImageSpan(
            start=start,
            length=mm_tokens_per_image,
            digest=_digest(k, ref.url, uuid, max_image_bytes, fetch),
            uuid=uuid,
        )
        for k, (ref, start, uuid) in enumerate(zip(refs, starts, uuids, strict=True))
    ]
    return PromptTokens(token_ids=token_ids, images=images, cache_salt=cache_salt, model=model)


_PROMPT_SHAPE = "prompt must be a string, a list of token ids, or a list holding one of those"


class _Walker:
    """Rule 5: encodes one text as far as ``reach`` wants, keeping the estimate of the rest."""

    def __init__(self, tokenizer: Tokenizer, reach: Reach, salt: str | None) -> None:
        self._walk = getattr(tokenizer, "walk", None)
        self._reach = reach
        self._salt = salt
        self.estimated = 0

    def encode(self, tokenizer: Tokenizer, text: str, special: bool) -> list[int]:
        if self._walk is None:
            return tokenizer.encode(text, add_special_tokens=special)
        walk = self._walk(text, add_special_tokens=special)
        step = FIRST_STEP_CHARS
        while not walk.done:
            walk.advance(step)
            if not walk.done and (walk.encoded_chars >= WALK_ENCODE_LIMIT_CHARS
                                  or not self._reach(walk.ids, self._salt)):
                self.estimated = walk.rest_tokens()
                break
            step *= 2
        ids: list[int] = walk.ids
        return ids


def _completion_ids(body: dict[str, Any], tokenizer: Tokenizer, check: bool = True,
                    walker: _Walker | None = None) -> list[int]:
    if "prompt" not in body:
        raise ValueError("prompt is required")
    prompt = body["prompt"]
    if (isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
            and all(isinstance(p, str | list) for p in prompt)):
        if len(prompt) > 1:
            raise ValueError("one prompt per request: prompt holds several prompts")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        special = _special_tokens(body, True)
        if walker is not None:
            return walker.encode(tokenizer, prompt, special)
        return tokenizer.encode(prompt, add_special_tokens=special)
    if not isinstance(prompt, list):
        raise ValueError(_PROMPT_SHAPE)
    if not prompt:
        raise ValueError("prompt must not be empty")
    if not check:
        return prompt
    vocab = tokenizer.vocab_size
    try:
        # Validated in C: an 8k-token prompt costs tens of microseconds, not milliseconds.
        return msgspec.convert(prompt, _token_ids_type(vocab))
    except msgspec.ValidationError:
        pass
    for i, t in enumerate(prompt):  # slow path, only to name the offending token
        if not _is_token_id(t):
            raise ValueError(_PROMPT_SHAPE) from None
        if not 0 <= t < vocab:
            raise ValueError(f"prompt token id {t} at index {i} is out of range [0, {vocab})")
    raise AssertionError("msgspec refused a prompt the slow path accepts")


def _special_tokens(body: dict[str, Any], default: bool) -> bool:
    """``add_special_tokens`` as vLLM reads it: on for completions, off for chat (whose
    template writes its own), either overridden by the request."""
    value = body.get("add_special_tokens", default)
    if type(value) is not bool:
        raise ValueError("add_special_tokens must be a boolean")
    return value


@functools.lru_cache(maxsize=8)
def _token_ids_type(vocab: int) -> Any:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab)]]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _chat_ids(
    body: dict[str, Any], tokenizer: Tokenizer, mm_tokens_per_image: int,
    walker: _Walker | None = None,
) -> tuple[list[int], list[ImageRef], list[int]]:
    if "messages" not in body:
        raise ValueError("messages is required")
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise ValueError("add_generation_prompt must be a boolean")
    text, refs = render_chat_with_images(
        body["messages"],
        tokenizer.chat_template,
        add_generation_prompt,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) - 1 != len(refs):
        # Only a template that drops or duplicates message content gets here.
        raise ValueError(
            f"the chat template rendered {len(pieces) - 1} image markers for {len(refs)} images"
        )
    special = _special_tokens(body, False)
    if walker is not None and not refs:
        return walker.encode(tokenizer, text, special), [], []
    segments = [tokenizer.encode(piece, add_special_tokens=special and k == 0)
                for k, piece in enumerate(pieces)]
    token_ids, starts = splice_images(segments, mm_tokens_per_image, tokenizer.image_token_id)
    return token_ids, refs, starts


def _merge_uuids(refs: list[ImageRef], listed: Any) -> list[str | None]:
    if listed is None:
        return [ref.uuid for ref in refs]
    if isinstance(listed, dict) and set(listed) == {"image"}:
        listed = listed["image"]
    if not isinstance(listed, list):
        raise ValueError("mm_uuids must be a list of strings or nulls, one per image")
    if len(listed) != len(refs):
        raise ValueError(
            f"UUID list does not match the images: {len(listed)} UUIDs for {len(refs)} images"
        )
    merged: list[str | None] = []
    for k, (ref, uuid) in enumerate(zip(refs, listed, strict=True)):
        if uuid is not None and (not isinstance(uuid, str) or not uuid):
            raise ValueError(f"mm_uuids[{k}] must be a non-empty string or null")
        if uuid is not None and ref.uuid is not None and uuid != ref.uuid:
            raise ValueError(f"image {k} has two different UUIDs (mm_uuids and its part)")
        merged.append(uuid if uuid is not None else ref.uuid)
    return merged


def _digest(k: int, url: str, uuid: str | None, max_bytes: int, fetch: Fetch | None) -> str | None:
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
        try:
            content = decode_data_url(url, max_bytes)
        except ValueError as e:
            raise ValueError(f"image {k}: {e}") from None
    elif scheme in ("http", "https"):
        fetched = fetch(url) if fetch is not None else None
        if fetched is None:
            return None
        if not fetched:
            raise ValueError(f"image {k}: image is empty")
        if len(fetched) > max_bytes:
            raise ValueError(f"image {k}: image is larger than {max_bytes} bytes")
        content = fetched
    else:
        raise ValueError(f"image {k}: URL must be a data: URL or an http(s) URL")
    return image_digest(content, uuid)
