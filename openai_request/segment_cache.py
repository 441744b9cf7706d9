"""A tokenizer that encodes text segment by segment and remembers each segment's ids.

:class:`SegmentedTokenizer` wraps an :class:`~openai_request.tokenizer.HFTokenizer`: it cuts
a text where :mod:`openai_request.segments` proves the ids of the pieces concatenate to the
ids of the whole, looks every segment up in a :class:`SegmentCache`, and encodes only the
misses (in one batch). A repeated prefix (the same document, the earlier turns of a
conversation) then costs a dictionary look-up per segment instead of a tokenization.

Notes:
    1. It is exact: ``encode`` returns what the wrapped tokenizer returns, and has the same
       :attr:`identity`. Where the file allows no cut it encodes the whole text, and
       :attr:`SegmentedTokenizer.mode` and the start-up log say so.
    2. The cache is keyed by the segment's text itself (Python's string hash, computed in C,
       then an exact comparison), so two segments never share ids by a hash collision. It is
       least-recently-used and bounded by an estimate of the memory it holds
       (:func:`entry_bytes`). Cuts at spaces come after :data:`SEGMENT_CHARS` characters,
       counted from the text's start or the last added token, so a repeated prefix is cut the
       same way every time.
    3. :meth:`SegmentedTokenizer.walk` encodes a text as far as a caller asks and no further;
       the rest is estimated from its UTF-8 bytes at the bytes-per-token ratio of all the
       segments this tokenizer has encoded (:attr:`SegmentedTokenizer.bytes_per_token`).
       Before each segment is encoded its token count is also estimated, so the ratio's
       error on real text is known (:class:`TokenizeStats`).
    4. Thread-safe: the cache is locked (the router tokenizes large bodies in a thread).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import NamedTuple

import tokenizers

from openai_request.segments import (
    CONTINUED,
    FRESH,
    Segment,
    continuing_spec,
    plan_splits,
    special_tokens_frame,
)
from openai_request.tokenizer import HFTokenizer

__all__ = ["SEGMENT_CHARS", "SegmentCache", "SegmentedTokenizer", "TokenizeStats", "Walk",
           "entry_bytes"]

log = logging.getLogger(__name__)

#: The fewest characters between two cuts at spaces: about 500 tokens of English, so a
#: segment's look-up (a few µs) is small against the tokenization it saves (~0.5 ms), and a
#: changed text re-encodes at most this much around each change.
SEGMENT_CHARS = 2048
#: The cache's default bound: about 30 prompts of 100 KB.
CACHE_BYTES = 64 * 1024 * 1024


def entry_bytes(text: str, ids: list[int]) -> int:
    """The memory a cached segment is counted as holding: its text, a list of ids and their
    int objects, and the entry's overhead (an estimate; CPython's exact figure varies)."""
    return len(text) + 40 * len(ids) + 200


class TokenizeStats(NamedTuple):
    """Counters of a :class:`SegmentedTokenizer`, for ``/metrics``."""

    hits: int
    misses: int
    cached_bytes: int
    cached_segments: int
    #: UTF-8 bytes and tokens of every segment encoded (misses), which set the ratio.
    encoded_bytes: int
    encoded_tokens: int
    #: Sum over encoded segments of ``|estimated - actual|`` tokens, before learning from it.
    estimate_error_tokens: int
    #: Tokens estimated, not encoded, by walks that stopped early.
    estimated_tokens: int


class SegmentCache:
    """Segment text to ids, least-recently-used, bounded by :func:`entry_bytes`.

    Args:
        max_bytes: the bound; 0 caches nothing.
    """

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[int, str], list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, str]) -> list[int] | None:
        """The ids cached for ``key`` (encoder, text), counted as a hit or a miss."""
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return ids

    def put(self, key: tuple[int, str], ids: list[int]) -> None:
        """Remember ``ids`` for ``key``, evicting the least recently used beyond the bound."""
        size = entry_bytes(key[1], ids)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= entry_bytes(key[1], old)
            self._entries[key] = ids
            self.bytes += size
            while self.bytes > self.max_bytes:
                evicted, evicted_ids = self._entries.popitem(last=False)
                self.bytes -= entry_bytes(evicted[1], evicted_ids)


class SegmentedTokenizer:
    """An :class:`HFTokenizer` that encodes by cached segments (module docstring).

    Args:
        inner: the tokenizer; its answers are the specification.
        cache_bytes: the cache's bound.
        segment_chars: the fewest characters between two cuts at spaces.
    """

    def __init__(self, inner: HFTokenizer, *, cache_bytes: int = CACHE_BYTES,
                 segment_chars: int = SEGMENT_CHARS) -> None:
        if segment_chars < 1:
            raise ValueError(f"segment_chars must be at least 1, got {segment_chars}")
        self.inner = inner
        self.cache = SegmentCache(cache_bytes)
        self.segment_chars = segment_chars
        backend = inner.backend
        self.plan = plan_splits(inner.spec, backend.get_added_tokens_decoder(),
                                bool(getattr(backend, "encode_special_tokens", False)))
        continuing = continuing_spec(inner.spec)
        self._encoders = {FRESH: backend, CONTINUED: backend if continuing is None
                          else tokenizers.Tokenizer.from_str(json.dumps(continuing))}
        self.frame = special_tokens_frame(
            lambda text, special: inner.encode(text, add_special_tokens=special))
        if self.plan.at_spaces:
            self.mode = "segments"
        elif self.plan.added is not None:
            self.mode = "added tokens"
        else:
            self.mode = "whole"
        self._stats_lock = threading.Lock()
        self._encoded_bytes = 0
        self._encoded_tokens = 0
        self._error = 0
        self._estimated = 0

    def log_mode(self) -> None:
        """Say at start how this tokenizer is cut, and why not further."""
        why = "; ".join(self.plan.notes)
        if self.mode == "segments":
            log.info("tokenizer %s: cached segments, cut at added tokens and spaces",
                     self.identity)
        else:
            log.warning("tokenizer %s: %s (%s)", self.identity,
                        "cached segments, cut at added tokens only" if self.mode
                        == "added tokens" else "encoding whole prompts, uncached", why)

    # The Tokenizer protocol, delegated.
    @property
    def identity(self) -> str:
        """The wrapped tokenizer's identity: the ids are the same."""
        return self.inner.identity

    @property
    def vocab_size(self) -> int:
        """The wrapped tokenizer's."""
        return self.inner.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        """The wrapped tokenizer's."""
        return self.inner.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The wrapped tokenizer's."""
        return self.inner.eos_token_id

    @property
    def image_token_id(self) -> int:
        """The wrapped tokenizer's."""
        return self.inner.image_token_id

    @property
    def bos_token(self) -> str:
        """The wrapped tokenizer's."""
        return self.inner.bos_token

    @property
    def eos_token(self) -> str:
        """The wrapped tokenizer's."""
        return self.inner.eos_token

    @property
    def chat_template(self) -> str | None:
        """The wrapped tokenizer's."""
        return self.inner.chat_template

    @property
    def max_bytes_per_token(self) -> int | None:
        """The wrapped tokenizer's."""
        return self.inner.max_bytes_per_token

    def decode(self, ids: list[int]) -> str:
        """The wrapped tokenizer's."""
        return self.inner.decode(ids)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Return exactly the wrapped tokenizer's ids of ``text``, from cached segments."""
        if not self.plan.splits or (add_special_tokens and self.frame is None):
            return self.inner.encode(text, add_special_tokens=add_special_tokens)
        walk = self.walk(text, add_special_tokens=add_special_tokens)
        walk.advance(len(text))
        return walk.ids

    def walk(self, text: str, *, add_special_tokens: bool = False) -> Walk:
        """Start encoding ``text`` as far as the caller asks (:class:`Walk`)."""
        if not self.plan.splits or (add_special_tokens and self.frame is None):
            return Walk(self, [], text, self.inner.encode(text,
                                                          add_special_tokens=add_special_tokens))
        segments = self.plan.split(text, self.segment_chars)
        head, tail = self.frame if add_special_tokens and self.frame else ([], [])
        return Walk(self, segments, text, list(head), tail)

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes per token over every segment encoded so far (4.0 before any)."""
        if not self._encoded_tokens:
            return 4.0
        return self._encoded_bytes / self._encoded_tokens

    def estimate(self, utf8_bytes: int) -> int:
        """Tokens that ``utf8_bytes`` of text are expected to take, and count them as
        estimated."""
        tokens = round(utf8_bytes / self.bytes_per_token)
        with self._stats_lock:
            self._estimated += tokens
        return tokens

    def stats(self) -> TokenizeStats:
        """The cache's and the estimate's counters."""
        c = self.cache
        return TokenizeStats(c.hits, c.misses, c.bytes, len(c), self._encoded_bytes,
                             self._encoded_tokens, self._error, self._estimated)

    def _encode(self, segments: list[Segment]) -> list[tuple[list[int], bool]]:
        """Ids of each segment and whether they were known (an added token, or cached); the
        others are encoded in one batch per encoder and cached."""
        out: list[tuple[list[int], bool]] = []
        missing: dict[int, list[int]] = {}
        for k, seg in enumerate(segments):
            if seg.token is not None:
                out.append(([seg.token], True))
                continue
            ids = self.cache.get((seg.encoder, seg.text))
            if ids is None:
                missing.setdefault(seg.encoder, []).append(k)
                out.append(([], False))  # encoded below
            else:
                out.append((ids, True))
        for encoder, where in missing.items():
            texts = [segments[k].text for k in where]
            encoded = self._encoders[encoder].encode_batch_fast(texts, add_special_tokens=False)
            for k, text, enc in zip(where, texts, encoded, strict=True):
                ids = enc.ids
                out[k] = (ids, False)
                self.cache.put((encoder, text), ids)
                self._learn(len(text.encode("utf-8")), len(ids))
        return out

    def _learn(self, utf8_bytes: int, tokens: int) -> None:
        with self._stats_lock:
            if self._encoded_tokens:
                expected = utf8_bytes * self._encoded_tokens / self._encoded_bytes
                self._error += round(abs(expected - tokens))
            self._encoded_bytes += utf8_bytes
            self._encoded_tokens += tokens


class Walk:
    """A text being encoded segment by segment, as far as the caller asks.

    Attributes:
        ids: the ids known so far (with the special-token head, and the tail once done).
        done: every segment is encoded.
        encoded_chars: characters this walk had to tokenize (not found in the cache).
    """

    def __init__(self, tokenizer: SegmentedTokenizer, segments: list[Segment], text: str,
                 ids: list[int], tail: list[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._segments = segments
        self._text = text
        self._next = 0
        self._chars = 0
        self._tail = tail or []
        self.ids = ids
        self.encoded_chars = 0
        self.done = not segments
        if self.done:
            self.ids.extend(self._tail)

    def advance(self, chars: int) -> int:
        """Encode the next segments, at least ``chars`` characters of them (whole segments)
        or up to the end; return how many ids were added."""
        if self.done:
            return 0
        start, goal = self._next, self._chars + chars
        end = start
        while end < len(self._segments) and self._chars < goal:
            self._chars += len(self._segments[end].text)
            end += 1
        before = len(self.ids)
        segments = self._segments[start:end]
        for seg, (ids, hit) in zip(segments, self._tokenizer._encode(segments), strict=True):
            self.ids.extend(ids)
            if not hit:
                self.encoded_chars += len(seg.text)
        self._next = end
        if end == len(self._segments):
            self.done = True
            self.ids.extend(self._tail)
        return len(self.ids) - before

    def rest_tokens(self) -> int:
        """The estimated tokens of what is not encoded yet (0 when done)."""
        if self.done:
            return 0
        rest = len(self._text[self._chars:].encode("utf-8"))
        return self._tokenizer.estimate(rest) + len(self._tail)
