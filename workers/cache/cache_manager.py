"""The worker's paged KV cache manager: which blocks each request holds, and what it reuses.

An engine drives it once per iteration:

1. :meth:`CacheManager.allocate` admits a request: it finds the longest cached prefix of the
   prompt (device tier, then host tier), references those blocks and takes fresh ones for the
   rest. Scarcity is a return value (``None``), and a refused allocation changes nothing.
2. The engine performs the returned copies (offloads first, then onboards), then computes the
   tokens after ``num_cached_tokens``.
3. :meth:`CacheManager.commit_computed` (chunked prefill) and
   :meth:`CacheManager.append_tokens` (each sampled token) commit full blocks whose KV is
   written, making them reusable. Generated tokens are reusable too, as in vLLM.
4. :meth:`CacheManager.free` releases a finished or preempted request.
5. :meth:`CacheManager.take_events` hands what happened to the event sink.

Hits are capped one token short of the prompt, as in vLLM: the engine must compute at least
the last prompt position to get logits, so a fully cached, block-aligned prompt recomputes its
last block (which stays a private duplicate; see :meth:`BlockPool.commit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from indexer.wire import MEDIUM_CPU, MEDIUM_GPU
from workers.cache.block_keys import BlockKey, KeyedBlock, Prompt, RequestBlocks
from workers.cache.block_pool import BlockCopy, BlockPool, CacheEvent

__all__ = ["Allocation", "CacheManager", "CacheStats", "Growth"]


@dataclass(frozen=True, slots=True)
class Allocation:
    """An admitted request's blocks and what the engine must do before computing.

    Attributes:
        block_ids: device blocks for every prompt position, in order (the block table).
        num_cached_tokens: leading prompt tokens whose KV is cached (device or host).
        num_host_cached_tokens: how many of those come from the host tier (cost a transfer).
        offload: device-to-host copies of evicted blocks; perform these first.
        onboard: host-to-device copies of host-tier hits; perform these second.
    """

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    num_host_cached_tokens: int
    offload: tuple[BlockCopy, ...]
    onboard: tuple[BlockCopy, ...]


@dataclass(frozen=True, slots=True)
class Growth:
    """Blocks a request gained for new tokens, and offload copies to perform before use."""

    new_block_ids: tuple[int, ...]
    offload: tuple[BlockCopy, ...]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since start, and usage now.

    Attributes:
        hits: allocations that found a cached prefix.
        misses: allocations that found none.
        query_tokens: prompt tokens of all allocations.
        hit_tokens: prompt tokens served from the cache (both tiers).
        host_hit_tokens: of those, tokens onboarded from the host tier.
        device_evictions: committed device blocks evicted (offloaded or dropped).
        host_evictions: host blocks evicted.
        offloads: device blocks copied to the host tier.
        onboards: host blocks copied back to the device.
        device_usage: fraction of device blocks held by requests.
        host_usage: fraction of host blocks occupied (0.0 without a host tier).
    """

    hits: int
    misses: int
    query_tokens: int
    hit_tokens: int
    host_hit_tokens: int
    device_evictions: int
    host_evictions: int
    offloads: int
    onboards: int
    device_usage: float
    host_usage: float


@dataclass(slots=True)
class _Request:
    blocks: RequestBlocks
    block_ids: list[int]
    num_committed: int  # leading full blocks that are cached (hit or committed)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CacheManager:
    """Requests' block tables over a :class:`BlockPool`, with prefix reuse.

    Args:
        num_blocks: device blocks.
        block_size: positions per block.
        host_blocks: host-tier blocks; 0 for none.

    Notes:
        1. A request holds ``ceil(num_tokens / block_size)`` device blocks, in order; a hold
           (:meth:`hold_cached`) holds only its prompt's leading cached blocks.
        2. Its first ``num_committed`` blocks are in the cache (hit or committed); blocks are
           committed only when full and computed, so a partial block is never shared.
        3. Every method either succeeds completely or changes nothing (refusals return
           ``None``; caller mistakes raise ``ValueError`` before any change).
        4. A pin (:meth:`pin_cached_keys`, a peer's read of blocks by key) references only
           blocks that are committed on the device already: it takes, evicts and copies
           nothing, and it never leaves fewer free blocks than its caller keeps for requests.
    """

    def __init__(self, num_blocks: int, block_size: int = 32, host_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, host_blocks)
        self._requests: dict[str, _Request] = {}
        self._pins: dict[str, tuple[int, ...]] = {}
        self._hits = 0
        self._misses = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._host_hit_tokens = 0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """Return the request's block table."""
        return tuple(self._get(request_id).block_ids)

    def num_tokens(self, request_id: str) -> int:
        """Return the request's positions: prompt plus appended tokens."""
        return self._get(request_id).blocks.num_tokens

    def allocate(self, request_id: str, prompt: Prompt) -> Allocation | None:
        """Admit a request: reuse its longest cached prefix and take blocks for the rest.

        Args:
            request_id: a new request's id.
            prompt: its prompt.

        Returns:
            The allocation, or ``None`` (nothing changed) when too few blocks are free.

        Raises:
            ValueError: ``request_id`` is already allocated.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already allocated")
        bs = self.block_size
        blocks = RequestBlocks(prompt, bs)
        n = blocks.num_tokens
        hits: list[tuple[str, int, KeyedBlock]] = []
        for i in range((n - 1) // bs):
            kb = blocks.block(i)
            b = self.pool.cached_block(kb.key)
            if b is not None:
                hits.append((MEDIUM_GPU, b, kb))
                continue
            h = self.pool.host_block(kb.key)
            if h is None:
                break
            hits.append((MEDIUM_CPU, h, kb))
        device_hits = [b for medium, b, _ in hits if medium == MEDIUM_GPU]
        host_hits = [h for medium, h, _ in hits if medium == MEDIUM_CPU]
        num_new = _cdiv(n, bs) - len(device_hits)
        reserved = sum(1 for b in device_hits if self.pool.is_evictable(b))
        if num_new > self.pool.num_free_blocks - reserved:
            return None

        # Reference the device hits first so that taking new blocks cannot evict them.
        self.pool.touch(device_hits)
        new, offload = self.pool.take_blocks(num_new, pinned_host=host_hits)
        fresh = iter(new)
        block_ids: list[int] = []
        to_onboard: list[tuple[int, int, KeyedBlock]] = []
        for medium, b, kb in hits:
            if medium == MEDIUM_GPU:
                block_ids.append(b)
            else:
                d = next(fresh)
                block_ids.append(d)
                to_onboard.append((b, d, kb))
        block_ids.extend(fresh)
        onboard = self.pool.onboard(to_onboard)
        self._requests[request_id] = _Request(blocks, block_ids, len(hits))

        cached, host_cached = len(hits) * bs, len(host_hits) * bs
        self._query_tokens += n
        self._hit_tokens += cached
        self._host_hit_tokens += host_cached
        if cached:
            self._hits += 1
        else:
            self._misses += 1
        return Allocation(tuple(block_ids), cached, host_cached, tuple(offload), tuple(onboard))

    def hold_cached(self, hold_id: str, prompt: Prompt) -> tuple[int, ...]:
        """Reference the leading full blocks of ``prompt`` that are cached on the device, and
        nothing else (no block is taken, evicted or copied): a prefill's KV, held for the
        decode worker that will read it, until :meth:`free` (``hold_id``).

        Returns:
            The held block ids, in prompt order (empty when the first block is not cached;
            the hold is recorded all the same, for :meth:`free`).

        Raises:
            ValueError: ``hold_id`` is already allocated.
        """
        if hold_id in self._requests:
            raise ValueError(f"request {hold_id!r} is already allocated")
        blocks = RequestBlocks(prompt, self.block_size)
        held: list[int] = []
        for i in range((blocks.num_tokens - 1) // self.block_size):
            b = self.pool.cached_block(blocks.block(i).key)
            if b is None:
                break
            held.append(b)
        self.pool.touch(held)
        self._requests[hold_id] = _Request(blocks, held, len(held))
        return tuple(held)

    def cached_run(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, are cached on either tier (an allocation
        of a prompt with these keys would hit them); reads only."""
        pool = self.pool
        for i, key in enumerate(keys):
            if pool.cached_block(key) is None and pool.host_block(key) is None:
                return i
        return len(keys)

    def pin_cached_keys(self, pin_id: str, keys: Sequence[BlockKey], keep_free: int = 0
                        ) -> tuple[int, ...]:
        """Reference the leading run of ``keys`` committed on the device (it stops at the
        first key that is not), until :meth:`unpin` (``pin_id``): blocks a peer reads by
        key, which must not be evicted or reused while their bytes are read (note 4).

        Args:
            pin_id: a new pin's name.
            keys: engine block keys, in chain order.
            keep_free: the run also stops before a block whose pin would leave fewer than
                this many blocks free or evictable (pinning an evictable block takes it
                from what a request can get).

        Returns:
            The pinned device blocks, in key order; empty when the first key is not cached
            (nothing is recorded then).

        Raises:
            ValueError: ``pin_id`` is pinned already.
        """
        if pin_id in self._pins:
            raise ValueError(f"pin {pin_id!r} is held already")
        pool = self.pool
        free = pool.num_free_blocks
        pinned: list[int] = []
        for key in keys:
            b = pool.cached_block(key)
            if b is None:
                break
            if pool.is_evictable(b):
                if free - 1 < keep_free:
                    break
                free -= 1
            pinned.append(b)
        if pinned:
            pool.touch(pinned)
            self._pins[pin_id] = tuple(pinned)
        return tuple(pinned)

    def unpin(self, pin_id: str) -> bool:
        """Let go of a pin's blocks (they stay cached); False, changing nothing, for an
        unknown pin."""
        pinned = self._pins.pop(pin_id, None)
        if pinned is None:
            return False
        self.pool.free(reversed(pinned))
        return True

    @property
    def num_pins(self) -> int:
        """Pins held now."""
        return len(self._pins)

    def commit_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """Record that KV is written for the first ``num_computed_tokens`` positions.

        Full blocks in that range are committed and become reusable. A count at or below an
        earlier one changes nothing.

        Raises:
            ValueError: unknown request, or more tokens than the request has.
        """
        req = self._get(request_id)
        if not 0 <= num_computed_tokens <= req.blocks.num_tokens:
            raise ValueError(
                f"request {request_id!r} has {req.blocks.num_tokens} tokens, "
                f"not {num_computed_tokens}"
            )
        full = num_computed_tokens // self.block_size
        if full <= req.num_committed:
            return
        self.pool.commit(
            [(req.block_ids[i], req.blocks.block(i)) for i in range(req.num_committed, full)]
        )
        req.num_committed = full

    def append_tokens(self, request_id: str, token_ids: Iterable[int]) -> Growth | None:
        """Append sampled tokens, taking blocks for them as needed.

        A token is sampled only after every earlier position was computed, so this first
        commits every full block so far (see :meth:`commit_computed`).

        Args:
            request_id: a running request.
            token_ids: the new tokens.

        Returns:
            The blocks gained (often none), or ``None`` (nothing changed) when too few blocks
            are free: the engine should preempt something and retry.

        Raises:
            ValueError: unknown request, or a token id outside [0, 2**64 - 1].
        """
        req = self._get(request_id)
        tokens = list(token_ids)
        need = _cdiv(req.blocks.num_tokens + len(tokens), self.block_size) - len(req.block_ids)
        if need > self.pool.num_free_blocks:
            return None
        num_computed = req.blocks.num_tokens
        req.blocks.append(tokens)  # validates every token before taking any
        self.commit_computed(request_id, num_computed)
        new, offload = self.pool.take_blocks(need)
        req.block_ids.extend(new)
        return Growth(tuple(new), tuple(offload))

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request's blocks, last block first.

        Raises:
            ValueError: unknown request.
        """
        req = self._get(request_id)
        del self._requests[request_id]
        self.pool.free(reversed(req.block_ids))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block on both tiers (records ``PoolCleared``).

        Returns:
            ``False``, changing nothing, while any request holds blocks.
        """
        return self.pool.reset()

    def take_events(self) -> list[CacheEvent]:
        """Return the cache facts since the last call, oldest first, for the event sink."""
        return self.pool.take_events()

    def stats(self) -> CacheStats:
        """Return the counters and current usage."""
        pool = self.pool
        return CacheStats(
            hits=self._hits,
            misses=self._misses,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            host_hit_tokens=self._host_hit_tokens,
            device_evictions=pool.device_evictions,
            host_evictions=pool.host_evictions,
            offloads=pool.offloads,
            onboards=pool.onboards,
            device_usage=pool.num_held_blocks / pool.num_blocks,
            host_usage=pool.num_host_cached_blocks / pool.host_blocks if pool.host_blocks else 0.0,
        )

    def _get(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}")
        return req
