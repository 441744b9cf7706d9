"""Router-local block hashing: the chained 64-bit hash the prefix index is keyed on.

The router cannot reproduce an engine's block hash (vLLM seeds its hash per process), so it
recomputes its own from the tokens of each stored block, as NVIDIA Dynamo does. The same
function hashes a request's prompt, so a request and an event that describe the same blocks
give the same hashes. This module is the executable specification; ``native/hash64.h`` computes
identical values in C, and golden vectors in ``tests/indexer/test_hashing.py`` pin both.

The function, over unsigned 64-bit words (all arithmetic modulo ``2**64``):

1. ``mix(a, b)``: the 128-bit product ``a * b`` folded to 64 bits as ``low ^ high`` (the
   wyhash / mum mixer).
2. A block's content is a list of words: each token id as its value (any int in
   ``[0, 2**64)``); a ``str`` token (a position of a multimodal item, whose digest engines put
   there) is the fixed :data:`IMAGE_WORD`; then, for each multimodal item overlapping the
   block, ``identity_hash(identity)`` and the item's offset.
3. ``absorb(words)``: pair ``p`` (words ``2p`` and ``2p + 1``, a missing last word is 0) adds
   ``mix(w[2p] ^ k, w[2p + 1] ^ k ^ P1)`` with ``k = (p + 1) * P0``. The pairs are independent,
   so a CPU multiplies several at once; the per-pair key makes the sum order-sensitive.
4. ``finish(prev, acc, n) = fmix64(mix(prev ^ P2 ^ n, acc ^ P3))``, with ``n`` the number of
   words and ``fmix64`` MurmurHash3's finaliser. A block's hash is
   ``finish(previous block's hash, absorb(content), len(content))``, so it names the prefix.
5. The chain starts from the reuse scope's seed (:func:`scope_seed`: LoRA and cache salt), so
   different scopes never share a prefix; :data:`GLOBAL_SEED` when there is no scope.

Never Python's ``hash()``: values are fixed across processes, machines and versions.

A cache salt enters the chain through :func:`scope_seed` as the string the engine publishes.
kvroute workers never publish a tenant's raw salt but its tag (:func:`salt_tag`):
``"salt:"`` + 16 hex digits of SHA-256(salt), or, when the cluster shares a secret
(``--salt-secret``), of HMAC-SHA256(secret, salt). A plain digest of a guessable salt can be
reversed by trying guesses; the keyed one cannot without the secret. The router computes the
same tag for a request's salt, so both sides seed the same chain.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from indexer.events import U64_MASK, Stored

__all__ = [
    "GLOBAL_SEED",
    "IMAGE_WORD",
    "SALT_TAG_HMAC",
    "SALT_TAG_SHA256",
    "UnhashableStore",
    "block_hashes",
    "event_hash_input",
    "identity_hash",
    "salt_tag",
    "scope_seed",
]

P0 = 0xA0761D6478BD642F
P1 = 0xE7037ED1A0B428DB
P2 = 0x8EBC6AF09C88C6E3
P3 = 0x589965CC75374CC3
#: The chain root when a request has no LoRA and no cache salt ("kvroute" in ASCII).
GLOBAL_SEED = 0x6B76726F75746500
#: The content word of a token position that holds a multimodal item ("image" in ASCII).
IMAGE_WORD = 0x696D616765000000
_IDENTITY_SEED = 0x6964656E74697479
_SCOPE_TAG = 0x73636F7065000000

#: How a worker's ``/model_info`` names its salt tags (``salt_hashing``): unkeyed or keyed.
SALT_TAG_SHA256 = "sha256-16"
SALT_TAG_HMAC = "hmac-sha256-16"

MmItems = Sequence[Sequence[tuple[str, int]]]


class UnhashableStore(ValueError):
    """A stored event whose blocks cannot be hashed: image positions without item offsets."""


def _mix(a: int, b: int) -> int:
    r = a * b
    return (r ^ (r >> 64)) & U64_MASK


def _fmix(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & U64_MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & U64_MASK
    return x ^ (x >> 33)


def _absorb(words: Sequence[int]) -> int:
    acc = 0
    k = 0
    n = len(words)
    for j in range(0, n, 2):
        k = (k + P0) & U64_MASK
        second = words[j + 1] if j + 1 < n else 0
        acc += _mix(words[j] ^ k, second ^ k ^ P1)
    return acc & U64_MASK


def _finish(prev: int, words: Sequence[int], n: int) -> int:
    return _fmix(_mix(prev ^ P2 ^ n, _absorb(words) ^ P3))


def identity_hash(identity: str) -> int:
    """Return the 64-bit hash of a multimodal item's identity (a UUID or a hex digest).

    The identity's UTF-8 bytes are read as little-endian 64-bit words (the last one padded
    with zero bytes) and finished with the byte length from a fixed seed.
    """
    data = identity.encode("utf-8")
    padded = data + b"\0" * (-len(data) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    return _finish(_IDENTITY_SEED, words, len(data))


def scope_seed(lora: str | None, salt: str | None) -> int:
    """Return the chain root for a reuse scope.

    Args:
        lora: the LoRA adapter's name (``"id:<n>"`` when an engine gives only its id), or None.
        salt: the cache salt exactly as the engine publishes it, or None.

    Returns:
        :data:`GLOBAL_SEED` when both are None, else a seed that no other scope shares.
    """
    if lora is None and salt is None:
        return GLOBAL_SEED
    words = [
        _SCOPE_TAG,
        0 if lora is None else 1,
        0 if lora is None else identity_hash(lora),
        0 if salt is None else 1,
        0 if salt is None else identity_hash(salt),
    ]
    return _finish(GLOBAL_SEED, words, len(words))


def salt_tag(salt: str, key: bytes | None = None) -> str:
    """Return how a cache salt is published: ``"salt:"`` + 16 hex digits of its digest.

    Args:
        salt: the tenant's cache salt.
        key: the cluster's salt secret; the digest is then HMAC-SHA256(key, salt), else
            SHA-256(salt).
    """
    data = salt.encode("utf-8")
    if key is None:
        digest = hashlib.sha256(data).hexdigest()
    else:
        digest = hmac.new(key, data, hashlib.sha256).hexdigest()
    return "salt:" + digest[:16]


def _u64(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= U64_MASK:
        raise ValueError(f"{what} must be an int in [0, 2**64), not {value!r}")
    return value


def block_hashes(
    tokens: Sequence[int | str],
    block_size: int,
    *,
    seed: int,
    parent: int | None = None,
    mm: MmItems | None = None,
) -> list[int]:
    """Return the chained local hash of each full block of ``tokens``.

    A trailing partial block is not hashed.

    Args:
        tokens: token ids (ints in ``[0, 2**64)``) or ``str`` at multimodal positions.
        block_size: tokens per block, at least 1.
        seed: the chain root (:func:`scope_seed`) used when ``parent`` is None.
        parent: the local hash of the block before the first one, for a chain's continuation.
        mm: per full block, the ``(identity, start_offset)`` of each multimodal item that
            overlaps it; at least one entry per full block when given.

    Returns:
        One unsigned 64-bit hash per full block, in chain order.

    Raises:
        ValueError: a token, seed, parent, block size or multimodal entry is out of range.
    """
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be a positive int, not {block_size!r}")
    prev = _u64(seed, "seed") if parent is None else _u64(parent, "parent")
    blocks = len(tokens) // block_size
    if mm is not None and len(mm) < blocks:
        raise ValueError(f"mm has {len(mm)} entries for {blocks} full blocks")
    out: list[int] = []
    for b in range(blocks):
        words: list[int] = []
        for t in tokens[b * block_size : (b + 1) * block_size]:
            if type(t) is int and 0 <= t <= U64_MASK:
                words.append(t)
            elif isinstance(t, str):
                words.append(IMAGE_WORD)
            else:
                raise ValueError(f"token ids are ints in [0, 2**64) or str, not {t!r}")
        for identity, offset in mm[b] if mm is not None else ():
            if not isinstance(identity, str):
                raise ValueError(f"a multimodal identity is a str, not {identity!r}")
            words.append(identity_hash(identity))
            words.append(_u64(offset, "a multimodal offset"))
        prev = _finish(prev, words, len(words))
        out.append(prev)
    return out


def _routing_version(event: Stored) -> int | None:
    routing = event.trtllm_image_routing
    version = routing.get("version") if routing else None
    return version if type(version) is int else None


def _extra_pairs(extra: object) -> list[tuple[str, int]]:
    if type(extra) is not list:
        return []
    return [
        (item[0], item[1])
        for item in extra
        if type(item) in (list, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and type(item[1]) is int
    ]


def _salt_from_extra(extra: object, lora: str | None) -> str | None:
    # vLLM writes a chain's first block as [lora_name?, [mm_id, offset]..., salt?, embeds?];
    # the salt is the string that is not the LoRA name (the last one, vLLM appends it).
    if type(extra) is not list:
        return None
    strings = [item for item in extra if isinstance(item, str) and item != lora]
    return strings[-1] if strings else None


def event_hash_input(event: Stored) -> tuple[int | None, list[list[tuple[str, int]]] | None]:
    """Return what hashing a stored event's blocks needs beyond its tokens.

    The identity of a multimodal item is its UUID when the event's ``trtllm_image_routing``
    has version 1 and the item carries one, else its content digest; items come from
    ``mm_keys`` or, for vLLM, from ``[identifier, offset]`` pairs in ``extra_keys``.

    Args:
        event: a stored event.

    Returns:
        ``(seed, mm)``: the scope seed for a root store (``parent_block_hash`` None; a child
        takes its scope from its parent's hash, so None there), and the per-block
        ``(identity, offset)`` lists for :func:`block_hashes` (None when no item overlaps).

    Raises:
        UnhashableStore: ``token_ids`` has image positions but the event names no items.
    """
    blocks = len(event.block_hashes)
    mm: list[list[tuple[str, int]]] | None = None
    if event.mm_keys is not None:
        by_uuid = _routing_version(event) == 1
        mm = [
            [(item.uuid if by_uuid and item.uuid else item.hash, item.start_offset)
             for item in items]
            for items in event.mm_keys
        ]
    elif event.extra_keys is not None:
        pairs = [_extra_pairs(extra) for extra in event.extra_keys]
        if any(pairs):
            mm = pairs + [[] for _ in range(blocks - len(pairs))]
    if mm is None and any(isinstance(t, str) for t in event.token_ids):
        raise UnhashableStore("image positions in token_ids but no mm_keys or extra_keys")
    seed = None
    if event.parent_block_hash is None:
        lora = event.lora_name
        if lora is None and event.lora_id is not None:
            lora = f"id:{event.lora_id}"
        salt = event.cache_salt
        if salt is None and event.extra_keys:
            salt = _salt_from_extra(event.extra_keys[0], lora)
        seed = scope_seed(lora, salt)
    return seed, mm
