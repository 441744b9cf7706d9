"""Scenarios for the prefix index, with exact counts after each event, on both cores."""

from __future__ import annotations

import logging
import types

import pytest

from indexer.events import Cleared, MmItem, Removed, Stored, Tier
from indexer.hashing import GLOBAL_SEED

BS = 4
DEVICE, HOST = 1, 2  # engine_hashes tier bits


def tokens(*blocks: int) -> list[int]:
    """One block of BS tokens per argument, each token equal to that argument."""
    return [t for b in blocks for t in [b] * BS]


def stored(hashes: list[int], parent: int | None, toks: list[int | str],
           medium: str | None = None, **kw: object) -> Stored:
    return Stored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks,
                  block_size=BS, medium=medium, **kw)  # type: ignore[arg-type]


@pytest.fixture
def index(impl: types.SimpleNamespace):
    return impl.PrefixIndex(BS)


def local(impl: types.SimpleNamespace, *blocks: int) -> list[int]:
    return impl.block_hashes(tokens(*blocks), BS, seed=GLOBAL_SEED)


def test_store_match_remove(impl: types.SimpleNamespace, index) -> None:
    q = local(impl, 1, 2, 3, 4)
    # Worker 0 stores blocks A B C (engine hashes 10 11 12); worker 1 stores A then B.
    index.apply(0, stored([10, 11, 12], None, tokens(1, 2, 3)))
    index.apply(1, stored([20], None, tokens(1)))
    index.apply(1, stored([21], 20, tokens(2)))
    assert index.match(q) == {0: (3, 3), 1: (2, 2)}
    assert index.num_blocks() == 3
    assert index.worker_blocks(0) == (3, 0)
    assert index.worker_blocks(1) == (2, 0)
    # Worker 0 evicts B: its run stops at A even though it still holds C.
    index.apply(0, Removed([11]))
    assert index.match(q) == {0: (1, 1), 1: (2, 2)}
    assert index.worker_blocks(0) == (2, 0)
    assert index.engine_hashes(0) == {10: DEVICE, 12: DEVICE}
    assert index.num_blocks() == 3
    # Worker 1 evicts A and B: B is now held by no one.
    index.apply_batch(1, [Removed([20]), Removed([21])])
    assert index.match(q) == {0: (1, 1)}
    assert index.num_blocks() == 2
    assert index.match(local(impl, 9)) == {}
    assert index.match([]) == {}
    assert index.stats()["stored_blocks"] == 5
    assert index.stats()["removed_blocks"] == 3


def test_unknown_parent_and_removal_are_counted(impl: types.SimpleNamespace, index) -> None:
    index.apply(0, stored([11], 99, tokens(2)))  # parent 99 never stored
    assert index.num_blocks() == 0
    assert index.stats()["unknown_parent"] == 1
    index.apply(0, stored([10], None, tokens(1)))
    index.apply(1, stored([11], 10, tokens(2)))  # 10 is worker 0's, not worker 1's
    assert index.stats()["unknown_parent"] == 2
    index.apply(0, Removed([77, 10, 10]))  # unknown, removed, already gone
    assert index.stats()["unknown_removal"] == 2
    assert index.stats()["removed_blocks"] == 1
    assert index.num_blocks() == 0
    index.apply(0, Removed([10], medium="CPU"))  # never on the host tier
    assert index.stats()["unknown_removal"] == 3


def test_block_size_mismatch_is_loud(impl: types.SimpleNamespace, index,
                                     caplog: pytest.LogCaptureFixture) -> None:
    wrong = Stored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * 8, block_size=8)
    with caplog.at_level(logging.WARNING):
        for _ in range(12):
            index.apply(3, wrong)
    assert index.stats()["block_size_mismatch"] == 12
    assert index.num_blocks() == 0
    # Rate-limited: the 1st and the 10th occurrence, not every one.
    warnings = [r for r in caplog.records if "block" in r.getMessage()]
    assert len(warnings) == 2
    assert "worker 3 stores blocks of 8 tokens but the index uses 4" in warnings[0].getMessage()


def test_block_size_mismatch_warns_per_worker(impl: types.SimpleNamespace, index,
                                              caplog: pytest.LogCaptureFixture) -> None:
    wrong = Stored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * 8, block_size=8)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            index.apply(3, wrong)
        # Worker 4's first mismatch warns although it is the index's 6th.
        index.apply(4, wrong)
        # A worker that left and came back warns again from its 1st.
        index.remove_worker(3)
        index.apply(3, wrong)
    warned = [r.getMessage().split()[1] for r in caplog.records if "block" in r.getMessage()]
    assert warned == ["3", "4", "3"]
    assert index.stats()["block_size_mismatch"] == 7


def test_tiers(impl: types.SimpleNamespace, index) -> None:
    q = local(impl, 1, 2, 3)
    index.apply(0, stored([10, 11, 12], None, tokens(1, 2, 3)))
    # Offload B and C to the host: resident on both tiers.
    index.apply(0, stored([11, 12], 10, tokens(2, 3), medium="CPU"))
    assert index.worker_blocks(0) == (3, 2)
    assert index.engine_hashes(0) == {10: DEVICE, 11: DEVICE | HOST, 12: DEVICE | HOST}
    # Evict B from the device: the any-tier run continues through the host copy.
    index.apply(0, Removed([11], medium="GPU"))
    assert index.match(q) == {0: (3, 1)}
    assert index.worker_blocks(0) == (2, 2)
    # Evict A from the device: no leading block is on the device any more.
    index.apply(0, Removed([10]))
    assert index.match(q) == {}
    index.apply(0, Removed([12], medium="CPU"))
    assert index.engine_hashes(0) == {11: HOST, 12: DEVICE}
    assert index.worker_blocks(0) == (1, 1)
    assert index.num_blocks() == 2


def test_clear_and_remove_worker(impl: types.SimpleNamespace, index) -> None:
    q = local(impl, 1, 2)
    index.apply(0, stored([10, 11], None, tokens(1, 2)))
    index.apply(1, stored([20, 21], None, tokens(1, 2)))
    index.store_hashes(1, q[:1], Tier.HOST)
    index.apply(1, Cleared())
    assert index.stats()["clears"] == 1
    assert index.match(q) == {0: (2, 2)}
    assert index.worker_blocks(1) == (0, 0)
    assert index.engine_hashes(1) == {}
    assert index.workers() == [0, 1]
    # A removal after the clear refers to blocks the worker no longer holds.
    index.apply(1, Removed([20]))
    assert index.stats()["unknown_removal"] == 1
    index.remove_worker(0)
    assert index.match(q) == {}
    assert index.num_blocks() == 0
    assert index.workers() == [1]
    index.remove_worker(0)  # unknown: nothing to do
    index.clear(5)
    assert index.workers() == [1]


def test_direct_residency_next_to_events(impl: types.SimpleNamespace, index) -> None:
    q = local(impl, 1, 2)
    index.store_hashes(7, q)
    index.store_hashes(7, q)  # idempotent
    assert index.match(q) == {7: (2, 2)}
    assert index.worker_blocks(7) == (2, 0)
    index.apply(7, stored([70], None, tokens(1)))
    assert index.worker_blocks(7) == (2, 0)
    # Dropping the prediction keeps what the events say.
    index.remove_hashes(7, q)
    assert index.match(q) == {7: (1, 1)}
    index.remove_hashes(7, q)  # no longer stored directly: ignored
    index.apply(7, Removed([70]))
    assert index.match(q) == {}
    assert index.num_blocks() == 0
    index.store_hashes(7, q, Tier.HOST)
    assert index.match(q) == {7: (2, 0)}
    assert index.worker_blocks(7) == (0, 2)
    assert index.engine_hashes(7) == {}
    index.remove_hashes(8, q)  # unknown worker: nothing to do


def test_two_engine_hashes_one_block(impl: types.SimpleNamespace, index) -> None:
    # The engine caches the same tokens twice (its key covers something ours does not).
    index.apply(0, stored([10], None, tokens(1)))
    index.apply(0, stored([11], None, tokens(1)))
    assert index.worker_blocks(0) == (1, 0)
    index.apply(0, Removed([10]))
    assert index.match(local(impl, 1)) == {0: (1, 1)}
    index.apply(0, Removed([11]))
    assert index.match(local(impl, 1)) == {}


def test_engine_hash_reused_for_other_tokens(impl: types.SimpleNamespace, index) -> None:
    # A restart without a clear: engine hash 10 now names other tokens.
    index.apply(0, stored([10, 11], None, tokens(1, 2)))
    index.apply(0, stored([10], None, tokens(5), medium="CPU"))
    assert index.match(local(impl, 1)) == {}
    assert index.match(local(impl, 5)) == {0: (1, 0)}
    assert index.engine_hashes(0) == {10: HOST, 11: DEVICE}
    assert index.worker_blocks(0) == (1, 1)


def test_bad_stores_are_counted_and_skipped(impl: types.SimpleNamespace, index) -> None:
    index.apply(0, stored([10], None, [1, 2, 3]))  # 3 tokens for a 4-token block
    index.apply(0, stored([-1], None, tokens(1)))  # not an unsigned 64-bit hash
    assert index.stats()["malformed_stores"] == 2
    index.apply(0, stored([10], None, [1, "ab", "ab", 2]))  # image without items
    assert index.stats()["unhashable_images"] == 1
    index.apply(0, stored([10], None, [1, 2, 3, 2**64]))
    assert index.stats()["bad_tokens"] == 1
    assert index.num_blocks() == 0
    assert index.workers() == []


def test_image_and_scoped_stores(impl: types.SimpleNamespace, index) -> None:
    digest = "3f" * 32
    index.apply(0, stored([10], None, [1, digest, digest, 2],
                          mm_keys=[[MmItem(digest, 0, "sku")]],
                          trtllm_image_routing={"version": 1}))
    index.apply(0, stored([11], 10, tokens(3)))  # a child inherits the image chain
    by_uuid = impl.block_hashes([1, "", "", 2, 3, 3, 3, 3], BS, seed=GLOBAL_SEED,
                                mm=[[("sku", 0)], []])
    assert index.match(by_uuid) == {0: (2, 2)}
    index.apply(1, stored([20], None, tokens(1), lora_name="sql", cache_salt="t"))
    assert index.match(local(impl, 1)) == {}
    scoped = impl.block_hashes(tokens(1), BS, seed=impl.scope_seed("sql", "t"))
    assert index.match(scoped) == {1: (1, 1)}


def test_caller_mistakes_raise(impl: types.SimpleNamespace, index) -> None:
    with pytest.raises(ValueError):
        impl.PrefixIndex(0)
    for worker in (-1, 2**31, "0", 1.0):
        with pytest.raises(ValueError):
            index.apply(worker, Cleared())
    with pytest.raises(ValueError):
        index.apply(0, "BlockStored")
    with pytest.raises(ValueError):
        index.store_hashes(0, [1], tier=2)
    with pytest.raises(ValueError):
        index.store_hashes(0, [-1])
    with pytest.raises(ValueError):
        index.match([1, 2**64])


def test_a_thousand_workers_share_a_prefix(impl: types.SimpleNamespace, index) -> None:
    q = local(impl, 1, 2, 3)
    for w in range(1024):
        index.apply(w * 1000, stored([5, 6], None, tokens(1, 2)))
        if w % 3 == 0:
            index.apply(w * 1000, stored([7], 6, tokens(3), medium="CPU"))
    result = index.match(q)
    assert len(result) == 1024
    assert result[0] == (3, 2)
    assert result[1000] == (2, 2)
    assert index.num_blocks() == 3
    for w in range(0, 1024, 2):
        index.remove_worker(w * 1000)
    assert len(index.match(q)) == 512
    assert index.match(q)[3000] == (3, 2)
    assert index.worker_blocks(3000) == (2, 1)


def test_memory_is_reported(impl: types.SimpleNamespace, index) -> None:
    empty = index.memory_bytes()
    index.apply(0, stored(list(range(100)), None, list(range(400))))
    assert index.memory_bytes() > empty > 0
