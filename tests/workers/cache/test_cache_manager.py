"""Cache manager scenarios: exact block ids, eviction order, host tier, and recorded facts."""

from __future__ import annotations

from typing import Any

import pytest

from workers.cache.block_keys import ImageSpan, Prompt, RequestBlocks, Scope, image_digest
from workers.cache.block_pool import BlockCopy, BlocksCommitted, BlocksEvicted, PoolCleared
from workers.cache.cache_manager import Allocation, CacheManager, Growth


def chain(tokens: list[int], block_size: int, scope: Scope | None = None) -> list[bytes]:
    """Keys of the full blocks of ``tokens``."""
    blocks = RequestBlocks(Prompt(tokens, scope=scope or Scope()), block_size)
    return [blocks.block(i).key for i in range(blocks.num_full_blocks)]


def facts(manager: CacheManager) -> list[tuple[Any, ...]]:
    """The recorded facts, with keys, in order."""
    out: list[tuple[Any, ...]] = []
    for e in manager.take_events():
        if isinstance(e, BlocksCommitted):
            out.append(("stored", e.medium, [kb.key for kb in e.blocks]))
        elif isinstance(e, BlocksEvicted):
            out.append(("removed", e.medium, list(e.keys)))
        else:
            assert isinstance(e, PoolCleared)
            out.append(("cleared",))
    return out


def test_prefix_reuse() -> None:
    m = CacheManager(num_blocks=10, block_size=4)
    k = chain(list(range(8)), 4)

    # A: 10 tokens -> blocks 0, 1, 2 (the last one partial); nothing cached yet.
    a = m.allocate("a", Prompt(list(range(10))))
    assert a == Allocation((0, 1, 2), 0, 0, (), ())
    assert facts(m) == []

    # A samples a token: positions 0..9 are computed, so full blocks 0 and 1 are committed
    # as one run. The partial block 2 is never shared.
    assert m.append_tokens("a", [100]) == Growth((), ())
    assert facts(m) == [("stored", "GPU", [k[0], k[1]])]

    # B shares A's first 8 tokens: it reuses blocks 0 and 1 and gets block 3 for the rest.
    b = m.allocate("b", Prompt([*range(8), 50, 51, 52]))
    assert b == Allocation((0, 1, 3), 8, 0, (), ())

    s = m.stats()
    assert (s.hits, s.misses, s.query_tokens, s.hit_tokens) == (1, 1, 21, 8)
    assert s.device_usage == pytest.approx(4 / 10)


def test_lru_eviction_order() -> None:
    m = CacheManager(num_blocks=4, block_size=2)
    k = chain([1, 2, 3, 4], 2)

    # A: [1 2][3 4][5] -> blocks 0, 1, 2; after one sampled token blocks 0 and 1 are committed.
    m.allocate("a", Prompt([1, 2, 3, 4, 5]))
    m.append_tokens("a", [6])
    assert facts(m) == [("stored", "GPU", [k[0], k[1]])]

    # Freeing releases last block first: block 2 (uncommitted) is free again, and the tail
    # block 1 becomes evictable before the head block 0.
    m.free("a")
    assert m.pool.evictable_blocks() == [1, 0]
    assert m.pool.num_free_blocks == 4

    # B needs 4 blocks and shares nothing: the free blocks 3 and 2 go first, then block 1
    # and block 0 are evicted, in that order.
    b = m.allocate("b", Prompt([9] * 7))
    assert b is not None and b.block_ids == (3, 2, 1, 0)
    assert facts(m) == [("removed", "GPU", [k[1], k[0]])]
    assert m.stats().device_evictions == 2


def test_hit_refreshes_lru_position() -> None:
    m = CacheManager(num_blocks=6, block_size=2)
    # A: [1 2][3 4] in blocks 0, 1; its sampled token takes block 2 and commits blocks 0, 1.
    m.allocate("a", Prompt([1, 2, 3, 4]))
    assert m.append_tokens("a", [5]) == Growth((2,), ())
    # X: [7 8][9 10] in blocks 3, 4, the same way, with block 5 for its sampled token.
    m.allocate("x", Prompt([7, 8, 9, 10]))
    assert m.append_tokens("x", [11]) == Growth((5,), ())
    m.free("a")
    m.free("x")
    # Evictable, oldest first: A's tail, A's head, X's tail, X's head. Blocks 2, 5 are free.
    assert m.pool.evictable_blocks() == [1, 0, 4, 3]

    # C reuses A's head (block 0) and takes the free block 2.
    c = m.allocate("c", Prompt([1, 2, 5]))
    assert c == Allocation((0, 2), 2, 0, (), ())
    assert m.pool.evictable_blocks() == [1, 4, 3]
    # Freed again, block 0 is now the most recently used.
    m.free("c")
    assert m.pool.evictable_blocks() == [1, 4, 3, 0]


def test_refused_allocation_changes_nothing() -> None:
    m = CacheManager(num_blocks=3, block_size=2)
    k = chain([1, 2, 3, 4], 2)
    m.allocate("a", Prompt([1, 2, 3, 4, 5]))
    m.append_tokens("a", [6])
    m.free("a")
    assert facts(m) == [("stored", "GPU", [k[0], k[1]])]
    assert m.pool.evictable_blocks() == [1, 0]
    before = m.stats()

    # B: 7 tokens need 4 blocks; 2 are hits on the evictable blocks 1 and 0, so 2 must be new,
    # but only block 2 is left once the hits are held. Refused, with nothing touched.
    assert m.allocate("b", Prompt([1, 2, 3, 4, 7, 8, 9])) is None
    assert "b" not in m
    assert m.pool.evictable_blocks() == [1, 0]
    assert m.pool.num_free_blocks == 3
    assert facts(m) == []
    assert m.stats() == before

    # C fits: the two hits and block 2.
    c = m.allocate("c", Prompt([1, 2, 3, 4, 7]))
    assert c == Allocation((0, 1, 2), 4, 0, (), ())


def test_aligned_prompt_recomputes_last_block() -> None:
    m = CacheManager(num_blocks=10, block_size=4)
    k = chain(list(range(1, 9)), 4)
    m.allocate("a", Prompt(list(range(1, 9))))
    m.append_tokens("a", [9])  # 9 tokens: block 2 is taken for the new one
    assert facts(m) == [("stored", "GPU", [k[0], k[1]])]
    m.free("a")

    # B is A's prompt exactly. Only block 0 counts as a hit: the engine must compute the last
    # position for logits, so block 1 is recomputed in the fresh block 3 (free before evictable).
    b = m.allocate("b", Prompt(list(range(1, 9))))
    assert b == Allocation((0, 3), 4, 0, (), ())
    # Committing block 3 finds k[1] already cached in block 1: it stays a private duplicate.
    m.append_tokens("b", [9])
    assert facts(m) == []
    m.free("b")
    assert m.pool.evictable_blocks() == [1, 0]


def test_chunked_prefill_commits_as_computed() -> None:
    m = CacheManager(num_blocks=10, block_size=4)
    k = chain(list(range(12)), 4)
    m.allocate("a", Prompt(list(range(12))))
    m.commit_computed("a", 5)  # block 0 full and computed, block 1 not yet
    assert facts(m) == [("stored", "GPU", [k[0]])]
    m.commit_computed("a", 12)
    assert facts(m) == [("stored", "GPU", [k[1], k[2]])]
    m.commit_computed("a", 8)  # an older count: nothing to do
    assert facts(m) == []
    with pytest.raises(ValueError, match="has 12 tokens"):
        m.commit_computed("a", 13)


def test_decode_growth_and_scarcity() -> None:
    m = CacheManager(num_blocks=2, block_size=2)
    k = chain([1, 2, 3, 4], 2)
    assert m.allocate("a", Prompt([1, 2])) == Allocation((0,), 0, 0, (), ())

    # Token 3 needs a second block; the first is now committed.
    assert m.append_tokens("a", [3]) == Growth((1,), ())
    assert facts(m) == [("stored", "GPU", [k[0]])]

    # Token 4 fits; token 5 would need a third block: refused, nothing appended or committed.
    assert m.append_tokens("a", [4]) == Growth((), ())
    assert m.append_tokens("a", [5]) is None
    assert m.num_tokens("a") == 4
    assert facts(m) == []
    assert m.block_ids("a") == (0, 1)


def test_scope_salt_in_upper_half() -> None:
    m = CacheManager(num_blocks=10, block_size=2)
    high = Scope(salt=2**63)
    m.allocate("a", Prompt([1, 2, 3], scope=high))
    m.append_tokens("a", [4])
    assert facts(m) == [("stored", "GPU", chain([1, 2], 2, high))]

    # Another tenant (salt 2**63 + 1), the base model, and "the same" salt as a string miss.
    for i, scope in enumerate([Scope(salt=2**63 + 1), Scope(), Scope(salt=str(2**63))]):
        alloc = m.allocate(f"miss{i}", Prompt([1, 2, 3], scope=scope))
        assert alloc is not None and alloc.num_cached_tokens == 0
    # The same salt hits.
    alloc = m.allocate("b", Prompt([1, 2, 3], scope=Scope(salt=2**63)))
    assert alloc is not None and alloc.num_cached_tokens == 2 and alloc.block_ids[0] == 0


def test_same_uuid_different_image_is_not_reused() -> None:
    m = CacheManager(num_blocks=10, block_size=4)

    def prompt(content: bytes) -> Prompt:
        return Prompt([0] * 9, (ImageSpan(0, 8, image_digest(content, "img-1"), "img-1"),))

    m.allocate("cat", prompt(b"cat"))
    m.append_tokens("cat", [1])  # blocks 0 and 1 hold the cat image
    # Same UUID over other bytes: another digest, no reuse.
    dog = m.allocate("dog", prompt(b"dog"))
    assert dog is not None and dog.num_cached_tokens == 0
    # The cat again: both blocks are reused.
    again = m.allocate("again", prompt(b"cat"))
    assert again is not None and again.num_cached_tokens == 8 and again.block_ids[:2] == (0, 1)


def test_host_tier_offload_and_onboard() -> None:
    m = CacheManager(num_blocks=3, block_size=2, host_blocks=2)
    k = chain([1, 2, 3, 4], 2)
    m.allocate("a", Prompt([1, 2, 3, 4, 5]))
    m.append_tokens("a", [6])
    m.free("a")
    facts(m)
    # Device: block 2 free; blocks 1 (k1) then 0 (k0) evictable. Host: empty.

    # B shares nothing and needs 3 blocks: block 2, then block 1 and block 0 are evicted, each
    # offloaded to the next free host block. The engine copies them out before reusing them.
    b = m.allocate("b", Prompt([7, 7, 7, 7, 7]))
    assert b == Allocation((2, 1, 0), 0, 0, (BlockCopy(1, 0), BlockCopy(0, 1)), ())
    # Each block is stored on the host before it leaves the device.
    assert facts(m) == [
        ("stored", "CPU", [k[1]]),
        ("removed", "GPU", [k[1]]),
        ("stored", "CPU", [k[0]]),
        ("removed", "GPU", [k[0]]),
    ]
    m.free("b")  # nothing of B was committed: blocks 0, 1, 2 are plainly free

    # C is A's prompt: both hits are on the host tier (k0 in host 1, k1 in host 0). They are
    # copied back into fresh device blocks and committed there; the host keeps its copies.
    c = m.allocate("c", Prompt([1, 2, 3, 4, 5]))
    assert c == Allocation((0, 1, 2), 4, 4, (), (BlockCopy(1, 0), BlockCopy(0, 1)))
    assert facts(m) == [("stored", "GPU", [k[0], k[1]])]
    s = m.stats()
    assert (s.offloads, s.onboards, s.host_hit_tokens, s.host_usage) == (2, 2, 4, 1.0)

    # Evicting an onboarded block again needs no copy: the host still holds it.
    m.free("c")
    d = m.allocate("d", Prompt([8, 8, 8, 8, 8]))
    assert d is not None and d.offload == ()
    assert facts(m) == [("removed", "GPU", [k[1], k[0]])]


def test_host_tier_lru_and_pinning() -> None:
    m = CacheManager(num_blocks=2, block_size=2, host_blocks=1)
    ka = chain([1, 2], 2)[0]
    kb = chain([5, 6], 2)[0]
    m.allocate("a", Prompt([1, 2, 3]))
    m.append_tokens("a", [4])  # commits ka in block 0
    m.free("a")
    m.allocate("b", Prompt([5, 6, 7]))  # takes block 1, evicts block 0: ka -> host 0
    m.append_tokens("b", [8])  # commits kb in block 1
    m.free("b")
    assert facts(m) == [
        ("stored", "GPU", [ka]),
        ("stored", "CPU", [ka]),
        ("removed", "GPU", [ka]),
        ("stored", "GPU", [kb]),
    ]

    # D hits ka on the host. Its second block evicts kb from block 1, but the only host block
    # is being read by D's onboard: kb is dropped rather than offloaded over it.
    d = m.allocate("d", Prompt([1, 2, 3]))
    assert d == Allocation((0, 1), 2, 2, (), (BlockCopy(0, 0),))
    assert facts(m) == [("removed", "GPU", [kb]), ("stored", "GPU", [ka])]
    m.free("d")

    # E takes the free block 1 and evicts ka from block 0: the host holds ka already, no copy.
    e = m.allocate("e", Prompt([9, 9, 9]))
    assert e is not None and e.block_ids == (1, 0) and e.offload == ()
    assert facts(m) == [("removed", "GPU", [ka])]
    m.append_tokens("e", [9])  # commits [9 9] in block 1
    m.free("e")
    facts(m)

    # F evicts [9 9] from block 1: the host is full, so ka is evicted from it first.
    f = m.allocate("f", Prompt([4, 4, 4]))
    assert f is not None and f.offload == (BlockCopy(1, 0),)
    k9 = chain([9, 9], 2)[0]
    assert facts(m) == [
        ("removed", "CPU", [ka]),
        ("stored", "CPU", [k9]),
        ("removed", "GPU", [k9]),
    ]
    assert m.stats().host_evictions == 1


def test_reset_prefix_cache() -> None:
    m = CacheManager(num_blocks=4, block_size=2, host_blocks=2)
    m.allocate("a", Prompt([1, 2, 3]))
    m.append_tokens("a", [4])
    facts(m)

    # A request holds blocks: refused, nothing recorded.
    assert m.reset_prefix_cache() is False
    assert facts(m) == []

    m.free("a")
    assert m.reset_prefix_cache() is True
    assert facts(m) == [("cleared",)]
    # Nothing is reusable and block ids start over.
    b = m.allocate("b", Prompt([1, 2, 3]))
    assert b == Allocation((0, 1), 0, 0, (), ())


def test_caller_mistakes() -> None:
    m = CacheManager(num_blocks=4, block_size=2)
    m.allocate("a", Prompt([1, 2, 3]))
    with pytest.raises(ValueError, match="already allocated"):
        m.allocate("a", Prompt([1]))
    for call in (
        lambda: m.free("x"),
        lambda: m.append_tokens("x", [1]),
        lambda: m.commit_computed("x", 1),
        lambda: m.block_ids("x"),
    ):
        with pytest.raises(ValueError, match="unknown request"):
            call()
    # A bad token: nothing appended, nothing committed.
    with pytest.raises(ValueError, match="token id"):
        m.append_tokens("a", [5, -5])
    assert m.num_tokens("a") == 3
    assert facts(m) == []
    with pytest.raises(ValueError, match="num_blocks"):
        CacheManager(num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        CacheManager(num_blocks=1, block_size=0)


def test_a_hold_references_only_the_leading_cached_blocks_and_takes_none() -> None:
    m = CacheManager(num_blocks=6, block_size=4)
    prompt = Prompt(list(range(14)))  # 3 full blocks, then a partial one
    m.allocate("prefill", prompt)
    m.commit_computed("prefill", 14)
    m.free("prefill")
    m.take_events()
    free = m.pool.num_free_blocks
    assert m.hold_cached("hold", prompt) == (0, 1, 2)
    assert not any(m.pool.is_evictable(b) for b in (0, 1, 2))
    assert m.pool.num_free_blocks == free - 3  # referenced, and nothing taken besides
    assert facts(m) == []  # nothing stored, evicted or copied
    with pytest.raises(ValueError, match="already allocated"):
        m.hold_cached("hold", prompt)
    m.free("hold")
    assert all(m.pool.is_evictable(b) for b in (0, 1, 2))
    # A prompt whose first block is not cached holds nothing; one cut short holds its head.
    assert m.hold_cached("miss", Prompt([99] * 9)) == ()
    other = Prompt([*range(8), 77, 78, 79, 80, 81])
    assert m.hold_cached("head", other) == (0, 1)
