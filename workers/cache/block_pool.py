"""The worker's pool of KV blocks: device blocks, an optional host tier, and what happened.

Device blocks hold KV for requests. A full block whose KV is computed is committed under its
engine key (:mod:`workers.cache.block_keys`) and can then be reused by any request with the same
prefix. When no free block is left, an unreferenced committed block is evicted; with a host
tier it is first offloaded there (the engine copies it), so a later prefix hit can copy it back
(onboard) instead of recomputing it.

The pool does no I/O. Every change a consumer of the event stream must know about is appended
to a list of facts (:class:`BlocksCommitted`, :class:`BlocksEvicted`, :class:`PoolCleared`) that
the caller drains with :meth:`BlockPool.take_events` and hands to the event sink. Copies the
engine must perform are returned as :class:`BlockCopy` values.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from indexer.wire import MEDIUM_CPU, MEDIUM_GPU
from workers.cache.block_keys import BlockKey, KeyedBlock

__all__ = [
    "BlockCopy",
    "BlockPool",
    "BlocksCommitted",
    "BlocksEvicted",
    "CacheEvent",
    "PoolCleared",
]


@dataclass(frozen=True, slots=True)
class BlocksCommitted:
    """Blocks committed on ``medium``, a chain run: each block's parent is the one before it."""

    medium: str
    blocks: tuple[KeyedBlock, ...]


@dataclass(frozen=True, slots=True)
class BlocksEvicted:
    """Blocks that left ``medium``, in the order they left."""

    medium: str
    keys: list[BlockKey]


@dataclass(frozen=True, slots=True)
class PoolCleared:
    """Every committed block, on every tier, is gone."""


CacheEvent = BlocksCommitted | BlocksEvicted | PoolCleared


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A block copy the engine must perform: device to host (offload) or back (onboard)."""

    src: int
    dst: int


class BlockPool:
    """Device blocks ``[0, num_blocks)`` and host blocks ``[0, host_blocks)``.

    Args:
        num_blocks: device blocks.
        host_blocks: host-tier blocks; 0 for no host tier.

    Notes:
        1. Block ids are stable: the engine indexes its KV tensors by them.
        2. A device block is in exactly one state: free (uncommitted, unreferenced), held
           (referenced by at least one request, committed or not), or evictable (committed,
           unreferenced, in the LRU queue).
        3. A key names at most one device block and at most one host block. The host tier is
           inclusive: onboarding copies a block back and leaves the host copy in place.
        4. Free blocks are used before any committed block is evicted. Evictable blocks leave
           in the order they became unreferenced; host blocks least recently used first.
        5. Every commit is recorded as stored and every departure from a tier as removed, in
           the order they happen; an offload records stored on "CPU" before removed on "GPU",
           so the block is never absent from a consumer's view in between.
    """

    def __init__(self, num_blocks: int, host_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if host_blocks < 0:
            raise ValueError(f"host_blocks must be at least 0, got {host_blocks}")
        self.num_blocks = num_blocks
        self.host_blocks = host_blocks
        self._ref = [0] * num_blocks
        self._committed: list[KeyedBlock | None] = [None] * num_blocks
        self._by_key: dict[BlockKey, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._host: list[KeyedBlock | None] = [None] * host_blocks
        self._host_by_key: dict[BlockKey, int] = {}
        self._host_free: deque[int] = deque(range(host_blocks))
        self._host_lru: OrderedDict[int, None] = OrderedDict()
        self._events: list[CacheEvent] = []
        self.device_evictions = 0
        self.host_evictions = 0
        self.offloads = 0
        self.onboards = 0

    # -- queries ---------------------------------------------------------------------------

    def cached_block(self, key: BlockKey) -> int | None:
        """Return the device block committed under ``key``, or ``None``."""
        return self._by_key.get(key)

    def host_block(self, key: BlockKey) -> int | None:
        """Return the host block holding ``key``, or ``None``."""
        return self._host_by_key.get(key)

    def is_evictable(self, block_id: int) -> bool:
        """Whether ``block_id`` is committed and unreferenced (could be evicted)."""
        return block_id in self._evictable

    @property
    def num_free_blocks(self) -> int:
        """Device blocks a request could get now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_empty_blocks(self) -> int:
        """Device blocks holding nothing: taking them evicts no cached block."""
        return len(self._free)

    @property
    def num_held_blocks(self) -> int:
        """Device blocks referenced by requests."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Committed device blocks (held or evictable)."""
        return len(self._by_key)

    @property
    def num_host_cached_blocks(self) -> int:
        """Occupied host blocks."""
        return len(self._host_by_key)

    def keys_on(self, medium: str) -> set[BlockKey]:
        """Return the keys committed on ``medium`` ("GPU" or "CPU")."""
        return set(self._by_key if medium == MEDIUM_GPU else self._host_by_key)

    def evictable_blocks(self) -> list[int]:
        """Evictable device blocks, next to be evicted first."""
        return list(self._evictable)

    # -- changes ---------------------------------------------------------------------------

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each committed block (a prefix hit), making it unevictable."""
        for b in block_ids:
            assert self._committed[b] is not None, f"touched block {b} is not committed"
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1

    def take_blocks(
        self, n: int, pinned_host: Iterable[int] = ()
    ) -> tuple[list[int], list[BlockCopy]]:
        """Take ``n`` device blocks for a request, evicting committed ones if needed.

        Args:
            n: how many blocks.
            pinned_host: host blocks that must survive (an onboard of this step still has to
                read them); an offload that finds no other host block drops the block.

        Returns:
            The blocks (each referenced once, uncommitted) and the offload copies the engine
            must perform before it writes to them.

        Raises:
            ValueError: fewer than ``n`` blocks are free or evictable (check
                :attr:`num_free_blocks` first).
        """
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} available")
        pinned = set(pinned_host)
        taken: list[int] = []
        copies: list[BlockCopy] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._evict(b, pinned, copies)
            assert self._ref[b] == 0, f"block {b} was free but referenced"
            self._ref[b] = 1
            taken.append(b)
        return taken, copies

    def commit(self, blocks: Sequence[tuple[int, KeyedBlock]], medium: str = MEDIUM_GPU) -> None:
        """Commit held device blocks under their keys, recording one stored fact per chain run.

        A block whose key is already committed elsewhere stays uncommitted: the cache keeps
        one copy per key, and the request simply holds a private duplicate.

        Args:
            blocks: (device block, its keyed content) in chain order.
            medium: the medium to record (device blocks are "GPU").
        """
        run: list[KeyedBlock] = []
        for b, kb in blocks:
            assert self._ref[b] > 0, f"committing unreferenced block {b}"
            assert self._committed[b] is None, f"block {b} committed twice"
            if kb.key in self._by_key:
                self._flush_run(medium, run)
                continue
            if run and kb.parent != run[-1].key:
                self._flush_run(medium, run)
            self._committed[b] = kb
            self._by_key[kb.key] = b
            run.append(kb)
        self._flush_run(medium, run)

    def onboard(self, copies: Sequence[tuple[int, int, KeyedBlock]]) -> list[BlockCopy]:
        """Commit device blocks that the engine fills from the host tier.

        Args:
            copies: (host block, held device block, keyed content) in chain order.

        Returns:
            The host-to-device copies for the engine.
        """
        for h, _, kb in copies:
            held = self._host[h]
            assert held is not None and held.key == kb.key, f"host block {h} holds another key"
            self._host_lru.move_to_end(h)
        self.commit([(d, kb) for _, d, kb in copies])
        self.onboards += len(copies)
        return [BlockCopy(h, d) for h, d, _ in copies]

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become free or evictable.

        Pass a request's blocks last first: its tail is then evicted before its head, which
        more requests are likely to share.
        """
        for b in block_ids:
            assert self._ref[b] > 0, f"freeing block {b} that no request holds"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._committed[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None

    def reset(self) -> bool:
        """Forget every committed block on both tiers and record :class:`PoolCleared`.

        Returns:
            ``False``, changing nothing, when a request still holds a device block.
        """
        if self.num_held_blocks:
            return False
        self._committed = [None] * self.num_blocks
        self._by_key.clear()
        self._evictable.clear()
        self._free = deque(range(self.num_blocks))
        self._host = [None] * self.host_blocks
        self._host_by_key.clear()
        self._host_lru.clear()
        self._host_free = deque(range(self.host_blocks))
        self._events.append(PoolCleared())
        return True

    def take_events(self) -> list[CacheEvent]:
        """Return the facts recorded since the last call, oldest first, and forget them."""
        events, self._events = self._events, []
        return events

    # -- internals -------------------------------------------------------------------------

    def _flush_run(self, medium: str, run: list[KeyedBlock]) -> None:
        if run:
            self._events.append(BlocksCommitted(medium, tuple(run)))
            run.clear()

    def _record_removed(self, medium: str, key: BlockKey) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlocksEvicted) and last.medium == medium:
            last.keys.append(key)
        else:
            self._events.append(BlocksEvicted(medium, [key]))

    def _evict(self, b: int, pinned: set[int], copies: list[BlockCopy]) -> None:
        kb = self._committed[b]
        assert kb is not None, f"evictable block {b} is not committed"
        self._committed[b] = None
        del self._by_key[kb.key]
        self.device_evictions += 1
        if self.host_blocks and kb.key not in self._host_by_key:
            h = self._take_host_block(pinned)
            if h is not None:
                self._host[h] = kb
                self._host_by_key[kb.key] = h
                self._host_lru[h] = None
                self.offloads += 1
                copies.append(BlockCopy(b, h))
                self._events.append(BlocksCommitted(MEDIUM_CPU, (kb,)))
        self._record_removed(MEDIUM_GPU, kb.key)

    def _take_host_block(self, pinned: set[int]) -> int | None:
        if self._host_free:
            return self._host_free.popleft()
        victim = next((h for h in self._host_lru if h not in pinned), None)
        if victim is None:
            return None
        del self._host_lru[victim]
        kb = self._host[victim]
        assert kb is not None, f"host block {victim} in the LRU holds nothing"
        self._host[victim] = None
        del self._host_by_key[kb.key]
        self.host_evictions += 1
        self._record_removed(MEDIUM_CPU, kb.key)
        return victim
