"""An OpenAI completions or chat request body, turned into token ids and image spans.

The router and the workers both call :func:`build_prompt` on the same body with the same
tokenizer (equal :attr:`~openai_request.tokenizer.Tokenizer.identity`), so they agree on every token
id, which is what makes the router's prefix lookups hit. The one thing they may not share is
the bytes of a remote image: the worker fetches ``http(s)`` images and the router does not
(its ``fetch`` returns ``None``). Such an image gets no digest, and the router's lookup stops
at it (:meth:`PromptTokens.matchable_tokens`). The worker hashes each image as it arrives and
drops its bytes (:mod:`workers.http.image_read_ahead`), so it hands over the digests it made
(``digests``, for the images and UUIDs :func:`image_refs` lists) instead of the bytes.

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
    5. :func:`walk_prompt`, given a tokenizer that walks (:class:`~openai_request.segment_cache.
       SegmentedTokenizer`), does not encode a text prompt without images: it returns a
       :class:`PromptWalk`, which its caller advances in doubling steps of
       :data:`FIRST_STEP_CHARS` characters for as long as it wants more; the rest is then
       estimated (:attr:`PromptTokens.estimated_tokens`). A walk also stops once it has had
       to tokenize :data:`WALK_ENCODE_LIMIT_CHARS` characters the cache did not hold, which
       bounds the time one request holds the router's event loop to what a 256 KB body took
       before walks (a prompt held further than that by the workers but new to this router,
       say after a restart, is then matched only that far). The router does this, asking its
       index between steps; a worker, which serves the prompt, never does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

import msgspec

from openai_request.chat import ImageRef, normalize_messages, render_chat_with_images
from openai_request.images import (
    IMAGE_MARKER,
    ImageSpan,
    decode_data_url,
    image_digest,
    splice_images,
)
from openai_request.tokenizer import Tokenizer

if TYPE_CHECKING:
    from openai_request.segment_cache import Walk

__all__ = ["FIRST_STEP_CHARS", "WALK_ENCODE_LIMIT_CHARS", "Fetch", "PromptTokens", "PromptWalk",
           "RemoteDigests", "build_prompt", "image_refs", "walk_prompt"]

#: Returns a remote image's bytes, or ``None`` when the caller cannot or will not fetch it.
Fetch = Callable[[str], bytes | None]
#: Returns the digest (:func:`~openai_request.images.image_digest`) a caller made of the remote
#: image at a URL with a UUID (or none), or ``None`` when it has none.
RemoteDigests = Callable[[str, str | None], str | None]
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
    digests: RemoteDigests | None = None,
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
        digests: the digests of the remote images, made by a caller that fetched and checked
            them itself (non-empty, within ``max_image_bytes``); when given, ``fetch`` is not
            asked.

    Returns:
        The prompt tokens.

    Raises:
        ValueError: the body is malformed (the message is an API error reason), or
            ``kind``, ``mm_tokens_per_image`` or ``max_image_bytes`` is invalid.
    """
    built = _build(body, kind, tokenizer, mm_tokens_per_image, max_image_bytes, fetch,
                   check_token_ids, walk=False, digests=digests)
    assert isinstance(built, PromptTokens), "only walk_prompt walks"
    return built


def walk_prompt(
    body: Any,
    kind: Literal["completions", "chat"],
    tokenizer: Tokenizer,
    *,
    mm_tokens_per_image: int,
    max_image_bytes: int,
    fetch: Fetch | None,
    check_token_ids: bool = True,
) -> PromptTokens | PromptWalk:
    """:func:`build_prompt`, but a text prompt without images that ``tokenizer`` can walk is
    left to its caller to encode step by step (rule 5): its walk is returned, not encoded.

    Raises:
        ValueError: as :func:`build_prompt`, for what it checks before a walk begins (the
            rest, :meth:`PromptWalk.prompt`).
    """
    return _build(body, kind, tokenizer, mm_tokens_per_image, max_image_bytes, fetch,
                  check_token_ids, walk=True)


def _build(body: Any, kind: str, tokenizer: Tokenizer, mm_tokens_per_image: int,
           max_image_bytes: int, fetch: Fetch | None, check_token_ids: bool, *,
           walk: bool, digests: RemoteDigests | None = None) -> PromptTokens | PromptWalk:
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

    walks = walk and hasattr(tokenizer, "walk")
    if kind == "completions":
        token_ids = _completion_ids(body, tokenizer, check_token_ids, walks)
        if isinstance(token_ids, _Text):
            return PromptWalk(token_ids, tokenizer, body, kind, cache_salt, model)
        if "mm_uuids" not in body:  # the common case, kept short: a router decides on it
            return PromptTokens(token_ids, [], cache_salt, model)
        refs: list[ImageRef] = []
        starts: list[int] = []
    else:
        chat_ids, refs, starts = _chat_ids(body, tokenizer, mm_tokens_per_image, walks)
        if isinstance(chat_ids, _Text):
            return PromptWalk(chat_ids, tokenizer, body, kind, cache_salt, model)
        token_ids = chat_ids
    uuids = _merge_uuids(refs, body.get("mm_uuids"))
    images = [
        ImageSpan(
            start=start,
            length=mm_tokens_per_image,
            digest=_digest(k, ref.url, uuid, max_image_bytes, fetch, digests),
            uuid=uuid,
        )
        for k, (ref, start, uuid) in enumerate(zip(refs, starts, uuids, strict=True))
    ]
    return PromptTokens(token_ids=token_ids, images=images, cache_salt=cache_salt, model=model)


_PROMPT_SHAPE = "prompt must be a string, a list of token ids, or a list holding one of those"


class _Text(NamedTuple):
    """A prompt's one text, to be walked (rule 5): the text and whether special tokens go in."""

    text: str
    special: bool


class PromptWalk:
    """Rule 5: a text prompt without images, encoded as far as its caller wants.

    Each :meth:`advance` encodes the next step (:data:`FIRST_STEP_CHARS` characters, then
    twice the step before); while it returns True the caller may look at :attr:`ids` and
    advance again, or stop. :meth:`prompt` then gives the prompt, the part not encoded
    estimated. The walk asks nothing of its caller: the caller decides between steps.
    """

    def __init__(self, text: _Text, tokenizer: Tokenizer, body: dict[str, Any], kind: str,
                 cache_salt: str | None, model: str | None) -> None:
        self._walk: Walk = tokenizer.walk(  # type: ignore[attr-defined]
            text.text, add_special_tokens=text.special)
        self._body = body
        self._kind = kind
        self._model = model
        self._step = FIRST_STEP_CHARS
        self._going = True
        #: The request's cache salt (the scope its blocks hash in).
        self.cache_salt = cache_salt

    @property
    def ids(self) -> list[int]:
        """The ids encoded so far (a prefix of the whole text's ids)."""
        ids: list[int] = self._walk.ids
        return ids

    def advance(self) -> bool:
        """Encode the next step; whether the caller may ask for another: the text is not all
        encoded and the walk is within its limit of characters the cache did not hold
        (:data:`WALK_ENCODE_LIMIT_CHARS`). Once it returns False it encodes nothing more."""
        walk = self._walk
        if not self._going or walk.done:
            self._going = False
            return False
        walk.advance(self._step)
        self._step *= 2
        self._going = not walk.done and walk.encoded_chars < WALK_ENCODE_LIMIT_CHARS
        return self._going

    def prompt(self) -> PromptTokens:
        """The prompt as far as it was walked, the rest estimated; call it once, when done
        advancing (the estimate is counted in the tokenizer's stats).

        Raises:
            ValueError: the body's ``mm_uuids`` is malformed (checked as :func:`build_prompt`
                checks it: not for a chat prompt walked short).
        """
        self._going = False
        rest = self._walk.rest_tokens()
        if rest and (self._kind == "chat" or "mm_uuids" not in self._body):
            return PromptTokens(self.ids, [], self.cache_salt, self._model, rest)
        _merge_uuids([], self._body.get("mm_uuids"))
        return PromptTokens(self.ids, [], self.cache_salt, self._model)


def _completion_ids(body: dict[str, Any], tokenizer: Tokenizer, check: bool = True,
                    walk: bool = False) -> list[int] | _Text:
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
        if walk:
            return _Text(prompt, special)
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
    body: dict[str, Any], tokenizer: Tokenizer, mm_tokens_per_image: int, walk: bool = False,
) -> tuple[list[int] | _Text, list[ImageRef], list[int]]:
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
    if walk and not refs:
        return _Text(text, special), [], []
    segments = [tokenizer.encode(piece, add_special_tokens=special and k == 0)
                for k, piece in enumerate(pieces)]
    token_ids, starts = splice_images(segments, mm_tokens_per_image, tokenizer.image_token_id)
    return token_ids, refs, starts


def image_refs(body: dict[str, Any]) -> list[ImageRef]:
    """A chat body's image parts in order, each with the UUID :func:`build_prompt` gives it
    (rule 3): what a caller that hashes the images itself needs to know before fetching.

    Raises:
        ValueError: the messages or ``mm_uuids`` are malformed, as :func:`build_prompt` says.
    """
    _, refs = normalize_messages(body.get("messages"))
    uuids = _merge_uuids(refs, body.get("mm_uuids"))
    return [ImageRef(ref.url, uuid) for ref, uuid in zip(refs, uuids, strict=True)]


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


def _digest(k: int, url: str, uuid: str | None, max_bytes: int, fetch: Fetch | None,
            digests: RemoteDigests | None = None) -> str | None:
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
        try:
            content = decode_data_url(url, max_bytes)
        except ValueError as e:
            raise ValueError(f"image {k}: {e}") from None
    elif scheme in ("http", "https"):
        if digests is not None:
            return digests(url, uuid)
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
