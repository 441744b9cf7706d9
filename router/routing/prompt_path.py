"""From a request body to the local block hashes the index is asked about.

The router tokenizes exactly as the workers do (the shared :mod:`openai_request.prompts`), then
hashes the prompt's full blocks with the shared :mod:`indexer.hashing`, in the terms the
workers' events use:

- Image positions hash as the item's identity, with ``(identity, offset)`` for every image
  overlapping a block, as TensorRT-LLM and kvroute workers publish them. The identity is the
  caller's UUID when the request gave one and the worker advertised image routing version 1;
  else the content digest of an inline image. An image the router cannot identify (a remote
  URL it does not fetch) ends the matchable prefix there.
- Scope: the LoRA adapter (when the request's model names one) and the cache salt, hashed as
  the worker publishes it (:func:`indexer.hashing.salt_tag` for kvroute workers, keyed by the
  cluster's salt secret when they say ``hmac-sha256-16``; raw for engines that publish it
  raw).

Under ``--tokenize match`` the router tokenizes only as far as the index holds the prompt:
the service advances the prompt's :class:`openai_request.prompts.PromptWalk` step by step,
:class:`PrefixReach` hashes each block as its tokens become known, and between steps the
service asks the index whether some worker still holds them all; past the first block no
worker holds, the rest of the prompt matters only by its length, which the tokenizer
estimates.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from indexer.hashing import SALT_TAG_HMAC, SALT_TAG_SHA256, salt_tag
from indexer.index import block_hashes, scope_seed
from openai_request.prompts import PromptTokens

__all__ = ["HashingTerms", "PrefixReach", "published_salt", "request_hashes"]

log = logging.getLogger(__name__)

SALT_SHA256_16 = SALT_TAG_SHA256
#: What a keyed salt stands for when the router lacks the secret: a scope no worker publishes.
_UNKEYED = "salt:no-secret"


@dataclass(frozen=True, slots=True)
class HashingTerms:
    """How one group of workers names blocks: what the router must mirror."""

    block_size: int
    by_uuid: bool = False
    salt_hashing: str | None = SALT_SHA256_16
    salt_key: bytes | None = None


@functools.cache
def _warn_no_secret() -> None:
    log.warning("workers key their salt tags but the router has no --salt-secret: salted "
                "requests match nothing cached")


def published_salt(salt: str | None, salt_hashing: str | None,
                   salt_key: bytes | None = None) -> str | None:
    """The cache salt as the worker writes it into its events.

    Args:
        salt: the request's cache salt.
        salt_hashing: the worker's ``salt_hashing`` (``sha256-16``, ``hmac-sha256-16``, or
            None for engines that publish the salt raw).
        salt_key: the cluster's salt secret, for ``hmac-sha256-16``. Without it a salted
            request matches nothing cached (no salt tag can be computed).
    """
    if salt is None:
        return None
    if salt_hashing == SALT_TAG_SHA256:
        return salt_tag(salt)
    if salt_hashing == SALT_TAG_HMAC:
        if salt_key is None:
            _warn_no_secret()
            return _UNKEYED
        return salt_tag(salt, salt_key)
    return salt


def request_hashes(prompt: PromptTokens, terms: HashingTerms, lora: str | None = None
                   ) -> list[int]:
    """Return the local hashes of the prompt's matchable full blocks.

    Args:
        prompt: the tokenized request.
        terms: how the target workers name blocks.
        lora: the LoRA adapter the request selects, if any.

    Raises:
        ValueError: a token id is not a non-negative int (the router does not check ids
            against the vocabulary; the worker does).
    """
    size = terms.block_size
    salt = prompt.cache_salt
    if salt is not None:
        salt = published_salt(salt, terms.salt_hashing, terms.salt_key)
    seed = scope_seed(lora, salt)
    if not prompt.images:  # the common case: hash the token list as it is, no copy
        hashes = block_hashes(prompt.token_ids, size, seed=seed)  # checks every full block
        for t in prompt.token_ids[len(hashes) * size:]:  # and the partial tail, here
            if type(t) is not int or t < 0:
                raise ValueError(f"token ids are non-negative ints, not {t!r}")
        return hashes
    limit = prompt.matchable_tokens(by_uuid=terms.by_uuid)
    blocks = limit // size
    tokens: list[int | str] = list(prompt.token_ids[: blocks * size])
    mm: list[list[tuple[str, int]]] = [[] for _ in range(blocks)]
    for span in prompt.images:
        if span.start >= blocks * size:
            break
        identity = span.uuid if terms.by_uuid and span.uuid is not None else span.digest
        assert identity is not None, "matchable_tokens stops before an unidentified image"
        end = min(span.end, blocks * size)
        tokens[span.start:end] = [identity] * (end - span.start)
        for b in range(span.start // size, (end - 1) // size + 1):
            mm[b].append((identity, max(0, b * size - span.start)))
    return block_hashes(tokens, size, seed=seed, mm=mm)


class PrefixReach:
    """Hashes a text prompt's blocks as they are tokenized.

    Give :meth:`extend` the ids known so far after each step of the prompt's walk (a growing
    prefix of one prompt's ids): it hashes the new full blocks after the last ones. Whether to
    walk on is the caller's to say, from how many of :attr:`hashes` some worker holds. Only
    for prompts without images (the walk never runs on those).

    Args:
        terms: how the target workers name blocks.
        lora: the LoRA adapter the request selects, if any.
    """

    def __init__(self, terms: HashingTerms, lora: str | None) -> None:
        self._terms = terms
        self._lora = lora
        self._seed: int | None = None
        self.hashes: list[int] = []
        #: It was extended: the prompt's ids came from a walking encode, never from the body.
        self.walked = False

    def extend(self, ids: list[int], salt: str | None) -> list[int]:
        """The hashes of the full blocks of ``ids`` (those hashed before, then the new)."""
        self.walked = True
        self._extend(ids, salt)
        return self.hashes

    def finish(self, prompt: PromptTokens) -> list[int]:
        """The hashes of all the prompt's full blocks (those hashed so far, then the rest)."""
        assert not prompt.images, "a reach walks prompts without images only"
        self._extend(prompt.token_ids, prompt.cache_salt)
        return self.hashes

    def _extend(self, ids: list[int], salt: str | None) -> None:
        size = self._terms.block_size
        if self._seed is None:
            published = published_salt(salt, self._terms.salt_hashing, self._terms.salt_key)
            self._seed = scope_seed(self._lora, published)
        start, stop = len(self.hashes) * size, len(ids) // size * size
        if stop > start:
            parent = self.hashes[-1] if self.hashes else None
            self.hashes.extend(block_hashes(ids[start:stop], size, seed=self._seed,
                                            parent=parent))
