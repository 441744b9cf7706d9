"""Event sink: batch shape, cap, parent drops, coalescing, reset, image hints, snapshot."""

from __future__ import annotations

import random

import pytest

from indexer.decode import decode_batch
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, MmKey, encode_batch
from workers.cache import block_pool as pool
from workers.cache.block_keys import (
    ImageSpan,
    KeyedBlock,
    Prompt,
    RequestBlocks,
    Scope,
    image_digest,
    salt_tag,
    wire_hash,
)
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import DROP_CAP, DROP_ORPHAN, EventSink
from workers.cache.image_hints import ImageHints


def keyed(prompt: Prompt, block_size: int = 2) -> list[KeyedBlock]:
    blocks = RequestBlocks(prompt, block_size)
    return [blocks.block(i) for i in range(blocks.num_full_blocks)]


def h(*blocks: KeyedBlock) -> list[int]:
    return [wire_hash(b.key) for b in blocks]


def stored(medium: str, *blocks: KeyedBlock) -> pool.BlocksCommitted:
    return pool.BlocksCommitted(medium, blocks)


def removed(medium: str, *blocks: KeyedBlock) -> pool.BlocksEvicted:
    return pool.BlocksEvicted(medium, [b.key for b in blocks])


def shape(events: list[object]) -> list[tuple[object, ...]]:
    """Each event as (type, medium, hashes, parent)."""
    out: list[tuple[object, ...]] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(("stored", e.medium, e.block_hashes, e.parent_block_hash))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", e.medium, e.block_hashes))
        else:
            assert isinstance(e, AllBlocksCleared)
            out.append(("cleared",))
    return out


B0, B1, B2, B3 = keyed(Prompt([1, 2, 3, 4, 5, 6, 7, 8]))
(C1,) = keyed(Prompt([1, 2, 9, 9]))[1:]  # a sibling of B1 under B0


def test_text_store_is_vllm_shaped() -> None:
    sink = EventSink()
    sink.capture([stored("GPU", B0, B1)])
    batch = sink.next_batch(ts=12.5, rank=3)
    assert batch is not None and batch.ts == 12.5 and batch.data_parallel_rank == 3
    assert batch.events == [
        BlockStored(
            block_hashes=h(B0, B1),
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    # Through the bytes and the router's lenient decoder, the same facts come back.
    [event] = decode_batch(encode_batch(batch)).events
    assert event.block_hashes == h(B0, B1) and event.token_ids == [1, 2, 3, 4]
    assert event.extra_keys is None and event.mm_keys is None
    assert event.trtllm_image_routing is None
    # Nothing pending: no batch.
    assert sink.next_batch(ts=13.0, rank=3) is None
    assert (sink.stats.batches, sink.stats.stored) == (1, 2)


def test_scope_on_a_chain_first_block_only() -> None:
    scope = Scope(lora_id=7, lora_name="sql", salt="tenant-a")
    b0, b1, b2 = keyed(Prompt([1, 2, 3, 4, 5, 6], scope=scope))
    sink = EventSink()
    sink.capture([stored("GPU", b0, b1), stored("GPU", b2)])
    batch = sink.next_batch(0.0, 0)
    assert batch is not None
    first, more = batch.events
    assert isinstance(first, BlockStored) and isinstance(more, BlockStored)
    # The chain's first block names the adapter and the salt's tag, never the raw salt.
    assert first.extra_keys == [["sql", salt_tag("tenant-a")], None]
    assert (first.lora_id, first.lora_name) == (7, "sql")
    # A continuation starts below the root: no extra keys at all.
    assert more.extra_keys is None and more.parent_block_hash == wire_hash(b1.key)
    assert b"tenant-a" not in encode_batch(batch)


def test_cap_drops_stores_and_their_children_never_removals() -> None:
    sink = EventSink(max_pending_stored=2)
    # Three stored blocks against a cap of 2: B2 is dropped when captured.
    sink.capture([stored("GPU", B0, B1, B2)])
    batch = sink.next_batch(0.0, 0)
    assert batch is not None and shape(batch.events) == [("stored", "GPU", h(B0, B1), None)]
    assert sink.stats.dropped == {DROP_CAP: 1, DROP_ORPHAN: 0}

    # Next batch: B3's parent B2 was never published, so a consumer could not attach B3.
    sink.capture([stored("GPU", B3)])
    assert sink.next_batch(1.0, 0) is None
    assert sink.stats.dropped == {DROP_CAP: 1, DROP_ORPHAN: 1}
    # B2's and B3's removals name blocks the consumer never saw: nothing to publish for them.
    sink.capture([removed("GPU", B3, B2)])
    assert sink.next_batch(1.5, 0) is None

    # Removals are never capped: both published blocks go in one batch, past the cap.
    sink.capture([stored("GPU", C1), removed("GPU", B1), removed("CPU"), removed("GPU", B0)])
    batch = sink.next_batch(2.0, 0)
    assert batch is not None and shape(batch.events) == [
        ("stored", "GPU", h(C1), wire_hash(B0.key)),
        ("removed", "GPU", h(B1)),
        ("removed", "GPU", h(B0)),
    ]


def test_store_and_remove_in_one_batch_publish_nothing() -> None:
    sink = EventSink()
    sink.capture([stored("GPU", B0), removed("GPU", B0)])
    assert sink.next_batch(0.0, 0) is None
    assert sink.stats.coalesced == 1

    # A run losing a middle block: B0 stays, B1 coalesces away, B2 can no longer attach.
    sink.capture([stored("GPU", B0, B1, B2), removed("GPU", B1)])
    batch = sink.next_batch(1.0, 0)
    assert batch is not None and shape(batch.events) == [("stored", "GPU", h(B0), None)]
    assert sink.stats.coalesced == 2 and sink.stats.dropped[DROP_ORPHAN] == 1
    # B2's later removal names nothing the consumer holds.
    sink.capture([removed("GPU", B2)])
    assert sink.next_batch(2.0, 0) is None

    # Removed (published before), stored again and removed again: only the first removal.
    sink.capture([removed("GPU", B0), stored("GPU", B0), removed("GPU", B0)])
    batch = sink.next_batch(3.0, 0)
    assert batch is not None and shape(batch.events) == [("removed", "GPU", h(B0))]

    # Another medium is another residency: an offload within the batch keeps the CPU copy.
    sink.capture([stored("GPU", B0), stored("CPU", B0), removed("GPU", B0)])
    batch = sink.next_batch(4.0, 0)
    assert batch is not None and shape(batch.events) == [("stored", "CPU", h(B0), None)]


def test_reset_is_ordered_uncapped_and_forgets_residency() -> None:
    sink = EventSink(max_pending_stored=2)
    sink.capture([stored("GPU", B0, B1)])
    sink.next_batch(0.0, 0)

    # In one batch: B2 stored, the cache cleared, then B0 and B1 cached again. The cap is
    # already reached by B2 and B0, yet the clear goes out, in place.
    sink.capture([stored("GPU", B2), pool.PoolCleared(), stored("GPU", B0, B1)])
    batch = sink.next_batch(1.0, 0)
    assert batch is not None and shape(batch.events) == [
        ("stored", "GPU", h(B2), wire_hash(B1.key)),
        ("cleared",),
        ("stored", "GPU", h(B0), None),
    ]
    assert sink.stats.dropped[DROP_CAP] == 1 and sink.stats.cleared == 1
    # The view after the clear holds only what was stored after it.
    assert [e.block_hashes for e in sink.snapshot_events()] == [h(B0)]

    # The same prefix is reported again once cached again.
    sink.capture([pool.PoolCleared(), stored("GPU", B0, B1)])
    batch = sink.next_batch(2.0, 0)
    assert batch is not None
    assert shape(batch.events) == [("cleared",), ("stored", "GPU", h(B0, B1), None)]


def test_reset_through_the_manager() -> None:
    m = CacheManager(num_blocks=4, block_size=2)
    sink = EventSink()
    for round_ in range(2):
        m.allocate("a", Prompt([1, 2, 3]))
        m.append_tokens("a", [4])
        m.free("a")
        sink.capture(m.take_events())
        batch = sink.next_batch(float(round_), 0)
        assert batch is not None and shape(batch.events) == [("stored", "GPU", h(B0), None)]
        assert m.reset_prefix_cache()
        sink.capture(m.take_events())
        batch = sink.next_batch(float(round_), 0)
        assert batch is not None and shape(batch.events) == [("cleared",)]


CAT = image_digest(b"cat", "u1")


def image_blocks() -> list[KeyedBlock]:
    # Positions: [0 CAT][CAT CAT][CAT 5]: a 4-position image over three blocks.
    return keyed(Prompt([0, 9, 9, 9, 9, 5], (ImageSpan(1, 4, CAT, "u1"),)))


def test_image_store_with_hints() -> None:
    sink = EventSink(hints=ImageHints())
    sink.capture([stored("GPU", *image_blocks())])
    batch = sink.next_batch(0.0, 0)
    assert batch is not None
    [event] = batch.events
    assert isinstance(event, BlockStored)
    assert event.token_ids == [0, CAT, CAT, CAT, CAT, 5]
    assert event.mm_keys == [
        [MmKey(hash=CAT, start_offset=0, uuid="u1")],
        [MmKey(hash=CAT, start_offset=1, uuid="u1")],
        [MmKey(hash=CAT, start_offset=3, uuid="u1")],
    ]
    assert event.trtllm_image_routing == {"version": 1}
    [decoded] = decode_batch(encode_batch(batch)).events
    assert decoded.mm_keys is not None and decoded.mm_keys[1][0].start_offset == 1


def test_image_store_without_hints_or_with_ambiguous_uuid() -> None:
    # Hints disabled: digests still published, no uuid, no routing extension.
    sink = EventSink()
    sink.capture([stored("GPU", *image_blocks())])
    batch = sink.next_batch(0.0, 0)
    assert batch is not None
    [event] = batch.events
    assert isinstance(event, BlockStored) and event.trtllm_image_routing is None
    assert event.mm_keys is not None and event.mm_keys[0] == [MmKey(hash=CAT, start_offset=0)]

    # A second request named the same digest otherwise: the hint is omitted, the store stays.
    hinted = EventSink(hints=ImageHints())
    hinted.observe_images([ImageSpan(1, 4, CAT, "another-name")])
    hinted.capture([stored("GPU", *image_blocks())])
    batch = hinted.next_batch(0.0, 0)
    assert batch is not None
    [event] = batch.events
    assert isinstance(event, BlockStored) and event.trtllm_image_routing == {"version": 1}
    assert event.mm_keys is not None and event.mm_keys[0] == [MmKey(hash=CAT, start_offset=0)]


def test_text_store_has_no_image_fields_even_with_hints() -> None:
    sink = EventSink(hints=ImageHints())
    sink.capture([stored("GPU", B0)])
    batch = sink.next_batch(0.0, 0)
    assert batch is not None
    [event] = batch.events
    assert isinstance(event, BlockStored)
    assert event.mm_keys is None and event.trtllm_image_routing is None


def test_snapshot_parents_first() -> None:
    sink = EventSink()
    sink.capture([stored("GPU", B0, B1), stored("GPU", B2)])
    sink.next_batch(0.0, 0)
    # A chain stored in two runs comes back as one.
    assert shape(sink.snapshot_events()) == [("stored", "GPU", h(B0, B1, B2), None)]

    # B1 offloaded (stored on CPU, removed from GPU), and a sibling C1 under B0.
    sink.capture([stored("CPU", B1), removed("GPU", B1), stored("GPU", C1)])
    sink.next_batch(1.0, 0)
    # Each block comes after its parent, whatever the medium: B2 (GPU) follows B1 (CPU).
    assert shape(sink.snapshot_events()) == [
        ("stored", "GPU", h(B0), None),
        ("stored", "CPU", h(B1), wire_hash(B0.key)),
        ("stored", "GPU", h(B2), wire_hash(B1.key)),
        ("stored", "GPU", h(C1), wire_hash(B0.key)),
    ]

    # With B0 gone, nothing left can be attached by a consumer starting from the snapshot.
    sink.capture([removed("GPU", B0)])
    sink.next_batch(2.0, 0)
    assert sink.snapshot_events() == []


def test_manager_offload_reaches_the_wire_in_order() -> None:
    m = CacheManager(num_blocks=2, block_size=2, host_blocks=1)
    sink = EventSink()
    m.allocate("a", Prompt([1, 2, 3]))
    m.append_tokens("a", [4])
    m.free("a")
    m.allocate("b", Prompt([7, 7, 7]))  # evicts B0's block: offloaded to the host
    sink.capture(m.take_events())
    batch = sink.next_batch(0.0, 0)
    # Stored and offloaded in one batch: the device store coalesces with its removal.
    assert batch is not None and shape(batch.events) == [("stored", "CPU", h(B0), None)]
    assert sink.stats.coalesced == 1


def test_rejects_bad_cap() -> None:
    with pytest.raises(ValueError, match="max_pending_stored"):
        EventSink(max_pending_stored=0)


@pytest.mark.parametrize(("seed", "cap"), [(0, 10_000), (1, 10_000), (2, 3), (3, 3)])
def test_random_workload_view_matches_the_cache(seed: int, cap: int) -> None:
    # Requests with shared prefixes come and go on a small cache with a host tier. After every
    # batch, what a consumer was told is what the cache holds; with a tight cap, a subset.
    rng = random.Random(seed)
    m = CacheManager(num_blocks=12, block_size=2, host_blocks=6)
    sink = EventSink(max_pending_stored=cap)
    prefixes = [[rng.randrange(5) for _ in range(6)] for _ in range(4)]
    running: list[str] = []
    for step in range(400):
        if running and rng.random() < 0.4:
            m.free(running.pop(rng.randrange(len(running))))
        elif running and rng.random() < 0.5:
            m.append_tokens(rng.choice(running), [rng.randrange(5)])
        else:
            tokens = [*rng.choice(prefixes)[: rng.randrange(1, 7)], rng.randrange(5)]
            if m.allocate(f"r{step}", Prompt(tokens)) is not None:
                running.append(f"r{step}")
        if not running and rng.random() < 0.05:
            assert m.reset_prefix_cache()
        sink.capture(m.take_events())
        sink.next_batch(float(step), 0)
        for medium in ("GPU", "CPU"):
            told, held = sink.resident_keys(medium), m.pool.keys_on(medium)
            assert told == held if sum(sink.stats.dropped.values()) == 0 else told <= held
    assert sink.stats.stored > 0 and sink.stats.removed > 0
    assert (sink.stats.dropped[DROP_CAP] > 0) == (cap == 3)
