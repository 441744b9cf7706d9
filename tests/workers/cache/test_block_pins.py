"""Pins by key (a peer's read of blocks): the leading run of cached keys, referenced without
taking, evicting or copying anything, stopping before it would take blocks the holder keeps
free; unpinned, the blocks are evictable again in the order they were let go."""

from __future__ import annotations

import pytest

from tests.workers.cache.test_cache_manager import chain
from workers.cache.block_keys import Prompt, Scope
from workers.cache.cache_manager import CacheManager


def cached(m: CacheManager, tokens: list[int], rid: str = "a") -> None:
    """Run a request of ``tokens`` to its end: its full blocks committed, then freed."""
    m.allocate(rid, Prompt(tokens))
    m.commit_computed(rid, len(tokens))
    m.free(rid)


def test_a_pin_holds_the_leading_run_of_cached_keys_and_stops_at_the_first_miss() -> None:
    m = CacheManager(num_blocks=8, block_size=4)
    cached(m, list(range(13)))  # blocks 0, 1, 2 committed; block 3 (partial) free again
    keys = chain(list(range(16)), 4)  # four keys: the fourth is not cached
    assert m.cached_run(keys) == 3
    m.take_events()

    assert m.pin_cached_keys("r", keys) == (0, 1, 2)
    # Nothing was stored, evicted or copied; the blocks are held, not evictable.
    assert m.take_events() == []
    assert m.pool.evictable_blocks() == []
    assert m.pool.num_free_blocks == 5
    # A miss in the middle ends the run there: later cached keys are not pinned.
    assert m.pin_cached_keys("s", [keys[0], bytes(32), keys[2]]) == (0,)
    assert m.unpin("r") and m.unpin("s")
    assert not m.unpin("r")  # a second unpin is a no-op
    # Unpinned last first: the tail goes before the head.
    assert m.pool.evictable_blocks() == [2, 1, 0]


def test_keys_of_another_salt_pin_nothing() -> None:
    m = CacheManager(num_blocks=8, block_size=4)
    cached(m, list(range(9)))
    other = chain(list(range(9)), 4, Scope(salt="tenant-b"))
    assert m.cached_run(other) == 0
    assert m.pin_cached_keys("r", other) == ()
    assert m.num_pins == 0 and m.pool.num_free_blocks == 8


def test_a_pin_never_takes_the_blocks_the_holder_keeps_free() -> None:
    m = CacheManager(num_blocks=4, block_size=4)
    cached(m, list(range(13)))  # three evictable blocks, one free: four available
    keys = chain(list(range(12)), 4)
    # Keeping three free for the holder's queued prefills, one block may be pinned.
    assert m.pin_cached_keys("r", keys, keep_free=3) == (0,)
    assert m.pool.num_free_blocks == 3
    # A block a request holds already costs nothing to pin.
    m.allocate("b", Prompt(list(range(9))))  # holds blocks 0 and 1 (hits) and one new
    assert m.pin_cached_keys("s", keys, keep_free=m.pool.num_free_blocks) == (0, 1)


def test_a_pin_id_is_taken_once_and_a_pinned_pool_is_not_reset() -> None:
    m = CacheManager(num_blocks=4, block_size=4)
    cached(m, list(range(5)))
    keys = chain(list(range(4)), 4)
    m.pin_cached_keys("r", keys)
    with pytest.raises(ValueError, match="held already"):
        m.pin_cached_keys("r", keys)
    assert not m.reset_prefix_cache()  # a read is in progress
    m.unpin("r")
    assert m.reset_prefix_cache()
