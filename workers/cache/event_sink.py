"""The event sink: turns cache facts into the KV event batches a worker publishes.

The engine hands the sink what its cache manager recorded (:meth:`EventSink.capture`) and,
once per iteration, closes a batch (:meth:`EventSink.next_batch`) for the publisher, which
numbers and sends it. The sink does no I/O and reads no clock: the caller passes the timestamp.

The sink keeps the consumer's view: which (medium, block) pairs a router that received every
batch so far believes resident. It publishes only what such a consumer can apply, and can
re-state that view for a router that lost track (:meth:`EventSink.snapshot_events`).

Wire shape (``docs/wire.md``, "What kvroute workers publish"): block hash = first 8 bytes of
the engine key; image positions carry the digest; ``mm_keys`` lists the images of each block,
with the routing hint when :class:`~workers.cache.image_hints.ImageHints` has one; a chain's first
block carries the scope in ``extra_keys`` (LoRA name, then the salt's tag, never the raw salt).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from indexer.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    MmKey,
    WireEvent,
)
from openai_request.images import ImageSpan
from workers.cache import block_pool as pool
from workers.cache.block_keys import BlockKey, KeyedBlock, wire_hash
from workers.cache.block_pool import CacheEvent
from workers.cache.image_hints import ImageHints

__all__ = ["DROP_CAP", "DROP_ORPHAN", "EventSink", "SinkStats"]

#: Drop reason: the batch already holds ``max_pending_stored`` stored blocks.
DROP_CAP = "cap"
#: Drop reason: the block's parent is not resident in the consumer's view, so a consumer could
#: not attach it (its parent was dropped, coalesced away or removed).
DROP_ORPHAN = "orphan"

_ROUTING_V1 = {"version": 1}


@dataclass(slots=True)
class SinkStats:
    """Counters since start, in blocks except ``batches`` and ``cleared``."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    coalesced: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {DROP_CAP: 0, DROP_ORPHAN: 0})


class EventSink:
    """Captures cache facts in order and publishes them as bounded, coalesced batches.

    Args:
        max_pending_stored: most stored blocks one batch may hold.
        hints: the publisher's image routing hints; ``None`` disables them (no ``uuid`` in
            ``mm_keys``, no ``trtllm_image_routing``).
        salt_key: the cluster's salt secret, which keys published salt tags; None: unkeyed.

    Notes:
        1. Facts are published in the order captured.
        2. At most ``max_pending_stored`` stored blocks wait per batch; later ones are dropped
           when captured (reason "cap"). Removals and clears are never dropped.
        3. A stored block is published only if its parent is resident in the consumer's view
           on some medium; otherwise it is dropped (reason "orphan"), and by the same rule
           so are its descendants.
        4. A block stored and removed on one medium within a batch publishes nothing.
        5. A removal is published only for a block the consumer was told about: a dropped
           block's removal would name a hash the consumer never saw.
        6. The pool's ``PoolCleared`` is published in place, after everything captured
           before it and outside the cap, and empties the view, so the same prefix is reported
           again once it is cached again.
    """

    def __init__(self, *, max_pending_stored: int = 4096, hints: ImageHints | None = None,
                 salt_key: bytes | None = None) -> None:
        if max_pending_stored < 1:
            raise ValueError(f"max_pending_stored must be at least 1, got {max_pending_stored}")
        self.max_pending_stored = max_pending_stored
        self.hints = hints
        self._salt_key = salt_key
        self.stats = SinkStats()
        self._pending: list[CacheEvent] = []
        self._pending_stored = 0
        self._resident: dict[tuple[str, BlockKey], KeyedBlock] = {}
        self._known: dict[BlockKey, int] = {}  # key -> on how many mediums it is resident

    def resident_keys(self, medium: str) -> set[BlockKey]:
        """Return the keys a consumer of every batch so far believes resident on ``medium``."""
        return {key for m, key in self._resident if m == medium}

    def observe_images(self, images: Iterable[ImageSpan]) -> None:
        """Learn a request's image UUIDs for the routing hints (call on admission).

        Stored blocks teach the hints too, but a request that reuses cached blocks stores
        nothing; this is how its UUIDs (and conflicts) are seen.
        """
        if self.hints is not None:
            for span in images:
                if span.digest is not None:
                    self.hints.observe(span.digest, span.uuid)

    def capture(self, events: Iterable[CacheEvent]) -> None:
        """Take cache facts (from ``CacheManager.take_events``) into the pending batch."""
        for event in events:
            if not isinstance(event, pool.BlocksCommitted):
                self._pending.append(event)
                continue
            if self.hints is not None:
                for kb in event.blocks:
                    for seg in kb.images:
                        self.hints.observe(seg.digest, seg.uuid)
            room = max(self.max_pending_stored - self._pending_stored, 0)
            kept = event.blocks[:room]
            self.stats.dropped[DROP_CAP] += len(event.blocks) - len(kept)
            if kept:
                self._pending.append(pool.BlocksCommitted(event.medium, kept))
                self._pending_stored += len(kept)

    def next_batch(self, ts: float, rank: int) -> KVEventBatch | None:
        """Close the pending batch.

        Args:
            ts: the batch timestamp (seconds).
            rank: the data-parallel rank.

        Returns:
            The batch, or ``None`` when nothing is left to publish.
        """
        facts, self._pending, self._pending_stored = self._pending, [], 0
        cancelled = self._coalesce(facts)
        out: list[WireEvent] = []
        for i, fact in enumerate(facts):
            if isinstance(fact, pool.BlocksCommitted):
                self._publish_stored(i, fact, cancelled, out)
            elif isinstance(fact, pool.BlocksEvicted):
                hashes = [wire_hash(k) for k in fact.keys if self._forget(fact.medium, k)]
                if hashes:
                    out.append(BlockRemoved(block_hashes=hashes, medium=fact.medium, group_idx=0))
                    self.stats.removed += len(hashes)
            else:
                assert isinstance(fact, pool.PoolCleared), f"unknown cache fact {fact!r}"
                out.append(AllBlocksCleared())
                self._resident.clear()
                self._known.clear()
                self.stats.cleared += 1
        if not out:
            return None
        self.stats.batches += 1
        return KVEventBatch(ts=ts, events=out, data_parallel_rank=rank)

    def snapshot_events(self) -> list[BlockStored]:
        """Return stored events that re-create the consumer's view, every parent first.

        The view is what the batches returned so far published (pending facts excluded).
        Blocks whose parent has since left every medium are left out: a consumer starting
        from the snapshot could not attach them.
        """
        children: dict[BlockKey | None, list[BlockKey]] = {}
        mediums: dict[BlockKey, list[str]] = {}
        for (medium, key), kb in self._resident.items():
            if key not in mediums:
                mediums[key] = []
                children.setdefault(kb.parent, []).append(key)
            mediums[key].append(medium)
        # Depth-first from the roots, so a chain comes out as one run per medium. A run is
        # placed where it was opened; its first block's parent was visited (and placed) before.
        runs: list[tuple[str, list[KeyedBlock]]] = []
        open_run: dict[str, int] = {}
        stack = list(reversed(children.get(None, [])))
        while stack:
            key = stack.pop()
            for medium in mediums[key]:
                kb = self._resident[(medium, key)]
                at = open_run.get(medium)
                if at is not None and runs[at][1][-1].key == kb.parent:
                    runs[at][1].append(kb)
                else:
                    open_run[medium] = len(runs)
                    runs.append((medium, [kb]))
            stack.extend(reversed(children.get(key, [])))
        return [self._stored_event(medium, blocks) for medium, blocks in runs]

    # -- internals -------------------------------------------------------------------------

    def _coalesce(self, facts: list[CacheEvent]) -> set[tuple[int, int]]:
        """Return (fact, block) positions of stores that a later removal in the batch undoes."""
        open_stores: dict[tuple[str, BlockKey], tuple[int, int]] = {}
        cancelled: set[tuple[int, int]] = set()
        for i, fact in enumerate(facts):
            if isinstance(fact, pool.BlocksCommitted):
                for j, kb in enumerate(fact.blocks):
                    open_stores[(fact.medium, kb.key)] = (i, j)
            elif isinstance(fact, pool.BlocksEvicted):
                for key in fact.keys:
                    at = open_stores.pop((fact.medium, key), None)
                    if at is not None:
                        cancelled.add(at)
                        self.stats.coalesced += 1
            else:
                open_stores.clear()
        return cancelled

    def _publish_stored(
        self,
        i: int,
        fact: pool.BlocksCommitted,
        cancelled: set[tuple[int, int]],
        out: list[WireEvent],
    ) -> None:
        run: list[KeyedBlock] = []
        for j, kb in enumerate(fact.blocks):
            if (i, j) in cancelled or (kb.parent is not None and kb.parent not in self._known):
                if (i, j) not in cancelled:
                    self.stats.dropped[DROP_ORPHAN] += 1
                if run:
                    out.append(self._stored_event(fact.medium, run))
                    run = []
                continue
            self._remember(fact.medium, kb)
            run.append(kb)
        if run:
            out.append(self._stored_event(fact.medium, run))

    def _remember(self, medium: str, kb: KeyedBlock) -> None:
        assert (medium, kb.key) not in self._resident, (
            "block stored twice on one medium without a removal: cache manager bookkeeping bug"
        )
        self._resident[(medium, kb.key)] = kb
        self._known[kb.key] = self._known.get(kb.key, 0) + 1
        self.stats.stored += 1

    def _forget(self, medium: str, key: BlockKey) -> bool:
        if self._resident.pop((medium, key), None) is None:
            return False
        left = self._known[key] - 1
        if left:
            self._known[key] = left
        else:
            del self._known[key]
        return True

    def _stored_event(self, medium: str, blocks: list[KeyedBlock]) -> BlockStored:
        first = blocks[0]
        scope = first.scope
        # The scope goes on a chain's first block only, as vLLM puts it there.
        extra = [_first_block_keys(kb, self._salt_key) for kb in blocks]
        mm_keys = None
        if any(kb.images for kb in blocks):
            lookup = self.hints.lookup if self.hints is not None else (lambda _d: None)
            mm_keys = [
                [
                    MmKey(hash=s.digest, start_offset=s.start_offset, uuid=lookup(s.digest))
                    for s in kb.images
                ]
                for kb in blocks
            ]
        return BlockStored(
            block_hashes=[wire_hash(kb.key) for kb in blocks],
            parent_block_hash=None if first.parent is None else wire_hash(first.parent),
            token_ids=[p for kb in blocks for p in kb.positions],
            block_size=len(first.positions),
            lora_id=scope.lora_id,
            medium=medium,
            lora_name=scope.lora_name,
            extra_keys=extra if any(e is not None for e in extra) else None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            mm_keys=mm_keys,
            trtllm_image_routing=(
                dict(_ROUTING_V1) if mm_keys is not None and self.hints is not None else None
            ),
        )


def _first_block_keys(kb: KeyedBlock, salt_key: bytes | None) -> list[str] | None:
    keys = kb.scope.published_keys(salt_key) if kb.parent is None else None
    return list(keys) if keys else None
