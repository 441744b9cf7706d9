"""Engine block keys: what the worker's cache manager decides reuse on.

A prompt's token sequence is cut into full blocks of ``block_size`` positions. Each full block
gets a key, a chained SHA-256 digest::

    root      = SHA-256("kvroute.root.v1" | lora_id | salt)
    key[0]    = SHA-256(root     | content of block 0)
    key[i]    = SHA-256(key[i-1] | content of block i)

A block's content is its positions, each either a token id or, where an image sits, the image's
content digest, followed by the (digest, offset within the image) of every image that overlaps
the block. Two blocks share KV only when their keys are equal, so keys stay 256-bit and are
never truncated for matching; the 64-bit wire hash (:func:`wire_hash`) is only a name on the
event stream.

Notes:
    1. The reuse scope is the LoRA id and the cache salt, each in the full unsigned 64-bit range;
       a salt may also be a string (the OpenAI-style ``cache_salt``). Every field is encoded
       with a type tag and a length, so ``1`` and ``"1"``, or "no salt" and an empty salt,
       never collide.
    2. Images enter by content digest (:func:`~openai_request.images.image_digest`, re-exported
       here:
       SHA-256 of the decoded bytes, or a digest over the UUID and the bytes when the caller
       names the image). A UUID alone never enters a key, so a reused UUID over different
       bytes cannot share KV.
    3. Partial blocks have no key: only full blocks are ever shared.
    4. Nothing here uses Python's ``hash()``: keys are the same in every process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated

import msgspec

from indexer import hashing
from openai_request.images import ImageSpan, image_digest

__all__ = [
    "U64_MAX",
    "BlockKey",
    "ImageSegment",
    "ImageSpan",
    "KeyedBlock",
    "Prompt",
    "RequestBlocks",
    "Scope",
    "image_digest",
    "salt_tag",
    "wire_hash",
]

#: A 32-byte SHA-256 digest naming one full block and, through the chain, its whole prefix.
BlockKey = bytes

U64_MAX = (1 << 64) - 1

_U64 = struct.Struct(">Q")
_ROOT_DOMAIN = b"kvroute.root.v1"
_ABSENT = b"\x00"
_INT = b"\x01"
_STR = b"\x02"
_TEXT_BLOCK = b"t"
_MIXED_BLOCK = b"m"
_HEX = frozenset("0123456789abcdef")


def wire_hash(key: BlockKey) -> int:
    """Return the block hash published on the wire: the key's first 8 bytes, big-endian."""
    return int.from_bytes(key[:8], "big")


def salt_tag(salt: str | int, key: bytes | None = None) -> str:
    """Return how a cache salt is published (:func:`indexer.hashing.salt_tag` of ``str(salt)``:
    ``"salt:"`` + 16 hex digits of SHA-256, or of HMAC-SHA256 under the cluster's ``key``).

    The raw salt never leaves the worker: anyone reading the event stream could otherwise
    learn tenants' salts.
    """
    return hashing.salt_tag(str(salt), key)


def _check_u64(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{name} must be in [0, 2**64 - 1], got {value}")


def _check_digest(digest: object) -> None:
    if not isinstance(digest, str) or len(digest) != 64 or not _HEX.issuperset(digest):
        raise ValueError(f"an image digest is 64 lowercase hex digits, got {digest!r}")


@dataclass(frozen=True)
class Scope:
    """Who may share a block: blocks of different scopes never share keys.

    Attributes:
        lora_id: the LoRA adapter id, or ``None`` for the base model. Enters the key.
        lora_name: the adapter's name, published with the blocks; needs a ``lora_id``.
        salt: the cache salt (str, or int in [0, 2**64 - 1]), or ``None``. Enters the key.
    """

    lora_id: int | None = None
    lora_name: str | None = None
    salt: str | int | None = None

    def __post_init__(self) -> None:
        if self.lora_id is not None:
            _check_u64("lora_id", self.lora_id)
        if self.lora_name is not None and self.lora_id is None:
            raise ValueError("lora_name needs a lora_id")
        if isinstance(self.salt, int):
            _check_u64("salt", self.salt)
        elif self.salt is not None and not isinstance(self.salt, str):
            raise ValueError(f"salt must be str or int, got {type(self.salt).__name__}")

    @cached_property
    def root_key(self) -> BlockKey:
        """The key every chain of this scope starts from (the parent of its first block)."""
        h = hashlib.sha256(_ROOT_DOMAIN)
        h.update(_ABSENT if self.lora_id is None else _INT + _U64.pack(self.lora_id))
        if self.salt is None:
            h.update(_ABSENT)
        elif isinstance(self.salt, int):
            h.update(_INT + _U64.pack(self.salt))
        else:
            raw = self.salt.encode("utf-8")
            h.update(_STR + _U64.pack(len(raw)) + raw)
        return h.digest()

    def published_keys(self, salt_key: bytes | None = None) -> list[str] | None:
        """The ``extra_keys`` entry of a chain's first block: LoRA name, then salt tag.

        Args:
            salt_key: the cluster's salt secret, which keys the tag; None for an unkeyed tag.
        """
        keys = []
        if self.lora_name is not None:
            keys.append(self.lora_name)
        if self.salt is not None:
            keys.append(salt_tag(self.salt, salt_key))
        return keys or None


_TOKEN_IDS = tuple[Annotated[int, msgspec.Meta(ge=0)], ...]


@dataclass(frozen=True)
class Prompt:
    """What a request brings to the cache: its tokens, its images and its scope.

    Attributes:
        token_ids: the prompt's token ids; image positions hold the model's placeholder id,
            which does not enter keys (the image's digest does).
        images: the images, in order, not overlapping, each inside ``token_ids`` and each with
            a digest.
        scope: the reuse scope.
    """

    token_ids: tuple[int, ...]
    images: tuple[ImageSpan, ...] = ()
    scope: Scope = field(default_factory=Scope)

    def __post_init__(self) -> None:
        # Accept any sequence from callers but hold immutable tuples.
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "images", tuple(self.images))
        if not self.token_ids:
            raise ValueError("a prompt needs at least one token")
        try:  # checked in C: a Python loop here cost ~10% of a simulated cluster's time
            msgspec.convert(self.token_ids, _TOKEN_IDS)
        except msgspec.ValidationError:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.token_ids):
                raise ValueError("token ids must be ints") from None
            raise ValueError("token ids must be in [0, 2**64 - 1]") from None
        if max(self.token_ids) > U64_MAX:  # msgspec lets larger Python ints through
            raise ValueError("token ids must be in [0, 2**64 - 1]")
        end = 0
        for span in self.images:
            _check_digest(span.digest)
            if span.length < 1 or span.start < end or span.end > len(self.token_ids):
                raise ValueError(
                    f"image at [{span.start}, {span.end}) overlaps another or lies outside "
                    f"the {len(self.token_ids)} prompt positions"
                )
            end = span.end

    def positions(self) -> list[int | str]:
        """Return the token ids with each image's positions replaced by its digest."""
        out: list[int | str] = list(self.token_ids)
        for span in self.images:
            out[span.start : span.end] = [span.digest] * span.length  # type: ignore[list-item]
        return out


@dataclass(frozen=True, slots=True)
class ImageSegment:
    """The part of one image that a block holds.

    Attributes:
        digest: the image's content digest.
        start_offset: offset, within the image, of the block's first position of it.
        uuid: the caller's UUID for the image (a routing hint only), or ``None``.
    """

    digest: str
    start_offset: int
    uuid: str | None = None


@dataclass(frozen=True, slots=True)
class KeyedBlock:
    """A full block's content and key: everything needed to publish it as stored.

    Attributes:
        key: the block's engine key.
        parent: the previous block's key, or ``None`` for a chain's first block.
        positions: ``block_size`` entries, token ids or image digests.
        images: the images overlapping the block, in position order.
        scope: the reuse scope the chain started from.
    """

    key: BlockKey
    parent: BlockKey | None
    positions: tuple[int | str, ...]
    images: tuple[ImageSegment, ...]
    scope: Scope


def _block_key(
    parent: BlockKey, positions: Sequence[int | str], images: Sequence[ImageSegment]
) -> BlockKey:
    h = hashlib.sha256(parent)
    if not images:
        h.update(_TEXT_BLOCK + struct.pack(f">{len(positions)}Q", *positions))
        return h.digest()
    h.update(_MIXED_BLOCK)
    for p in positions:
        h.update(_STR + bytes.fromhex(p) if isinstance(p, str) else _INT + _U64.pack(p))
    for seg in images:
        h.update(bytes.fromhex(seg.digest) + _U64.pack(seg.start_offset))
    return h.digest()


class RequestBlocks:
    """One request's token sequence and the keys of its full blocks, extended as it grows.

    Args:
        prompt: the request's prompt.
        block_size: positions per block.
    """

    def __init__(self, prompt: Prompt, block_size: int) -> None:
        self.prompt = prompt
        self.block_size = block_size
        self._positions = prompt.positions()
        self._blocks: list[KeyedBlock] = []

    @property
    def num_tokens(self) -> int:
        """Positions in the sequence: prompt plus generated tokens."""
        return len(self._positions)

    @property
    def num_full_blocks(self) -> int:
        """How many blocks of the sequence are full."""
        return len(self._positions) // self.block_size

    def append(self, token_ids: Iterable[int]) -> None:
        """Extend the sequence with generated tokens.

        Raises:
            ValueError: a token id is not an int in [0, 2**64 - 1]; nothing was appended.
        """
        tokens = list(token_ids)
        for t in tokens:  # all checked before any is taken: a bad call changes nothing
            _check_u64("token id", t)
        self._positions.extend(tokens)

    def block(self, index: int) -> KeyedBlock:
        """Return full block ``index`` with its key, keying earlier blocks first if needed.

        Raises:
            ValueError: block ``index`` is not full.
        """
        if not 0 <= index < self.num_full_blocks:
            raise ValueError(f"block {index} is not full ({self.num_tokens} tokens)")
        bs = self.block_size
        while len(self._blocks) <= index:
            i = len(self._blocks)
            parent = self._blocks[-1].key if self._blocks else None
            start, stop = i * bs, (i + 1) * bs
            positions = tuple(self._positions[start:stop])
            images = tuple(
                ImageSegment(s.digest, max(start, s.start) - s.start, s.uuid)  # type: ignore[arg-type]
                for s in self.prompt.images
                if s.start < stop and s.end > start
            )
            key = _block_key(parent or self.prompt.scope.root_key, positions, images)
            self._blocks.append(KeyedBlock(key, parent, positions, images, self.prompt.scope))
        return self._blocks[index]
