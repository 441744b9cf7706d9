"""Image routing hints: a bounded map from image content digest to the caller's UUID.

A worker publishes an image's UUID next to its digest (``mm_keys[...].uuid``) so that a router
can match a later request that names the image by UUID without sending its bytes. The UUID is a
hint only: the worker's reuse decision stays on content digests (:mod:`workers.cache.block_keys`).

Rules (``trtllm_image_routing`` version 1, ``docs/wire.md``):
    1. At most ``capacity`` digests are remembered; the least recently used is forgotten first.
    2. A UUID longer than 256 UTF-8 bytes is ignored.
    3. A digest seen with two different UUIDs becomes ambiguous: no hint is given for it until
       it is forgotten. Ambiguity costs a router a cache miss; a wrong hint could cost more.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["MAX_UUID_BYTES", "ImageHints"]

MAX_UUID_BYTES = 256

# Stands for "seen with two UUIDs" in the map; never equal to a caller's str.
_AMBIGUOUS = object()


class ImageHints:
    """The digest -> UUID hints of one publisher.

    Args:
        capacity: how many digests to remember.

    Attributes:
        oversize: UUIDs ignored for being over :data:`MAX_UUID_BYTES`.
        conflicts: digests that became ambiguous.
        evictions: digests forgotten to stay within ``capacity``.
    """

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._uuids: OrderedDict[str, object] = OrderedDict()
        self.oversize = 0
        self.conflicts = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._uuids)

    def observe(self, digest: str, uuid: str | None) -> None:
        """Learn that a request named the image with ``digest`` as ``uuid`` (``None``: unnamed)."""
        if uuid is None:
            return
        if len(uuid.encode("utf-8")) > MAX_UUID_BYTES:
            self.oversize += 1
            return
        known = self._uuids.get(digest)
        if known is None:
            self._uuids[digest] = uuid
            if len(self._uuids) > self.capacity:
                self._uuids.popitem(last=False)
                self.evictions += 1
            return
        self._uuids.move_to_end(digest)
        if known is not _AMBIGUOUS and known != uuid:
            self._uuids[digest] = _AMBIGUOUS
            self.conflicts += 1

    def lookup(self, digest: str) -> str | None:
        """Return the UUID to publish for ``digest``: ``None`` when unknown or ambiguous."""
        known = self._uuids.get(digest)
        if known is None:
            return None
        self._uuids.move_to_end(digest)
        return known if isinstance(known, str) else None
