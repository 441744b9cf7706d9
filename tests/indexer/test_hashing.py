"""Router-local block hashing: golden vectors, and request-side vs event-side agreement."""

from __future__ import annotations

import random
import types

import pytest

from indexer.events import MmItem, Stored
from indexer.hashing import (
    GLOBAL_SEED,
    SALT_TAG_HMAC,
    SALT_TAG_SHA256,
    UnhashableStore,
    event_hash_input,
    salt_tag,
)
from router.routing.prompt_path import published_salt

U64 = 2**64 - 1
DIGEST = "3f" * 32


def test_golden_vectors(impl: types.SimpleNamespace) -> None:
    # Pinned values: a change here changes every router's hashes; bump them deliberately.
    assert GLOBAL_SEED == 0x6B76726F75746500
    assert impl.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, seed=GLOBAL_SEED) == [
        0xF1DBD6C114AF074A, 0x5F03A5AA65EDF438]
    assert impl.scope_seed(None, None) == GLOBAL_SEED
    assert impl.scope_seed("sql-adapter", None) == 0x249D957BA701BF41
    assert impl.scope_seed(None, "tenant-salt") == 0xAFFC78D3A0C7DA2C
    assert impl.scope_seed("sql-adapter", "tenant-salt") == 0xD60B830D29FA29AA
    assert impl.identity_hash("") == 0xAF30E9A38DCA7F13
    assert impl.identity_hash("sku-001") == 0xDC9E2E3E24E31CEB
    assert impl.identity_hash(DIGEST) == 0x1177F739D272ECD9
    mm = [[("sku-001", 0)], [("sku-001", 1), ("x", 7)]]
    assert impl.block_hashes([1, "3f", U64, 0], 2, seed=GLOBAL_SEED, mm=mm) == [
        0xCBB75AF222A2B216, 0xA1559B008D0459C5]
    assert impl.block_hashes(list(range(16)), 16, seed=impl.scope_seed(None, "s")) == [
        0x8C89169F534344C7]


def test_compiled_reader_agrees_on_edge_values(both) -> None:
    # The compiled core reads one-digit ints in place and takes slower paths for zero (a
    # 0-digit int), multi-digit ints and str; every path must give the reference's hashes.
    ref, nat = both
    rng = random.Random(7)
    edges = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, U64, "x"]
    for _ in range(200):
        tokens = [rng.choice(edges) if rng.random() < 0.05 else rng.randrange(150_000)
                  for _ in range(rng.randrange(0, 200))]
        block_size = rng.choice([1, 2, 3, 16, 32])
        mm = [[("item", 0)]] * (len(tokens) // block_size) if "x" in tokens else None
        assert nat.block_hashes(tokens, block_size, seed=GLOBAL_SEED, mm=mm) == \
            ref.block_hashes(tokens, block_size, seed=GLOBAL_SEED, mm=mm)
    # Large results are built from their digits: check them against Python's own ints.
    out = nat.block_hashes(list(range(4096)), 1, seed=GLOBAL_SEED)
    assert out == ref.block_hashes(list(range(4096)), 1, seed=GLOBAL_SEED)
    assert all(type(h) is int and int(str(h)) == h for h in out)


def test_chain_shape(impl: types.SimpleNamespace) -> None:
    tokens = list(range(100, 110))
    full = impl.block_hashes(tokens, 3, seed=GLOBAL_SEED)
    # Three full blocks; the trailing partial block (one token) is not hashed.
    assert len(full) == 3
    # A continuation from the parent's hash gives the same chain.
    assert impl.block_hashes(tokens[3:9], 3, seed=0, parent=full[0]) == full[1:]
    # One hash names the whole prefix: changing the first block changes every hash.
    other = impl.block_hashes([0, *tokens[1:]], 3, seed=GLOBAL_SEED)
    assert all(a != b for a, b in zip(full, other, strict=True))
    assert impl.block_hashes(tokens[:2], 3, seed=GLOBAL_SEED) == []
    assert impl.block_hashes([], 3, seed=GLOBAL_SEED) == []


def test_scopes_never_share_a_prefix(impl: types.SimpleNamespace) -> None:
    tokens = [7] * 8
    seeds = {impl.scope_seed(lora, salt)
             for lora in (None, "", "a", "b") for salt in (None, "", "a", "b")}
    assert len(seeds) == 16
    firsts = {impl.block_hashes(tokens, 4, seed=s)[0] for s in seeds}
    assert len(firsts) == 16


def test_image_positions(impl: types.SimpleNamespace) -> None:
    # Any str at an image position is the same IMAGE word: the identity enters through mm.
    a = impl.block_hashes([1, DIGEST, DIGEST, 2], 4, seed=GLOBAL_SEED, mm=[[(DIGEST, 0)]])
    b = impl.block_hashes([1, "x", "y", 2], 4, seed=GLOBAL_SEED, mm=[[(DIGEST, 0)]])
    assert a == b
    # The identity and the offset both matter; so does a placeholder int vs a str.
    assert a != impl.block_hashes([1, "x", "y", 2], 4, seed=GLOBAL_SEED, mm=[[("u", 0)]])
    assert a != impl.block_hashes([1, "x", "y", 2], 4, seed=GLOBAL_SEED, mm=[[(DIGEST, 1)]])
    assert a != impl.block_hashes([1, 9, 9, 2], 4, seed=GLOBAL_SEED, mm=[[(DIGEST, 0)]])


@pytest.mark.parametrize(("tokens", "kwargs"), [
    ([1, -1], {}),
    ([1, 2**64], {}),
    ([1, 2.0], {}),
    ([1, True], {}),
    ([1, 2], {"mm": []}),
    ([1, 2], {"mm": [[(5, 0)]]}),
    ([1, 2], {"mm": [[("x", -1)]]}),
    ([1, 2], {"parent": -1}),
])
def test_bad_input_is_a_value_error(impl: types.SimpleNamespace, tokens: list,
                                    kwargs: dict) -> None:
    with pytest.raises(ValueError):
        impl.block_hashes(tokens, 2, seed=GLOBAL_SEED, **kwargs)


@pytest.mark.parametrize("block_size", [0, -1, 1.5, None])
def test_bad_block_size(impl: types.SimpleNamespace, block_size: object) -> None:
    with pytest.raises(ValueError):
        impl.block_hashes([1, 2], block_size, seed=GLOBAL_SEED)


def _event_hashes(impl: types.SimpleNamespace, event: Stored) -> list[int]:
    seed, mm = event_hash_input(event)
    return impl.block_hashes(event.token_ids, event.block_size, seed=seed, mm=mm)


def _request_hashes(impl: types.SimpleNamespace, tokens: list[int | str], *,
                    lora: str | None = None, salt: str | None = None,
                    mm: list[list[tuple[str, int]]] | None = None) -> list[int]:
    return impl.block_hashes(tokens, 4, seed=impl.scope_seed(lora, salt), mm=mm)


def test_request_and_event_agree_on_text(impl: types.SimpleNamespace) -> None:
    tokens = list(range(1, 13))
    event = Stored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=tokens,
                   block_size=4)
    assert _event_hashes(impl, event) == _request_hashes(impl, [*tokens, 99])


def test_request_and_event_agree_on_lora_and_salt(impl: types.SimpleNamespace) -> None:
    tokens = [5, 6, 7, 8]
    # vLLM: the LoRA name in its field and extra_keys, the salt last in the first block's keys.
    vllm = Stored(block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=4,
                  lora_name="sql", lora_id=3, extra_keys=[["sql", "salt:0123456789abcdef"]])
    assert _event_hashes(impl, vllm) == _request_hashes(
        impl, tokens, lora="sql", salt="salt:0123456789abcdef")
    # SGLang: a top-level cache_salt.
    sglang = Stored(block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=4,
                    cache_salt="tenant-a")
    assert _event_hashes(impl, sglang) == _request_hashes(impl, tokens, salt="tenant-a")
    # An engine that names its adapter only by id.
    by_id = Stored(block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=4,
                   lora_id=7)
    assert _event_hashes(impl, by_id) == _request_hashes(impl, tokens, lora="id:7")
    assert len({tuple(_event_hashes(impl, e)) for e in (vllm, sglang, by_id)}) == 3


def test_salt_tags_golden_and_keyed(impl: types.SimpleNamespace) -> None:
    # Unkeyed: "salt:" + SHA-256(salt)[:16], the tag workers have always published.
    assert salt_tag("tenant-a") == "salt:80a707af7dc77ee1"
    # Keyed by the cluster's secret: HMAC-SHA256(secret, salt)[:16]; a guess at the salt
    # cannot be checked against the tag without the secret.
    keyed = salt_tag("tenant-a", b"cluster-secret")
    assert keyed == "salt:ec93422ca7936794"
    assert salt_tag("tenant-a", b"other-secret") not in (keyed, salt_tag("tenant-a"))
    assert impl.scope_seed(None, keyed) == 0x3845E1F3CD31B947
    # The router tags a request's salt as the worker says it does.
    assert published_salt("tenant-a", SALT_TAG_SHA256) == salt_tag("tenant-a")
    assert published_salt("tenant-a", SALT_TAG_HMAC, b"cluster-secret") == keyed
    assert published_salt("tenant-a", None) == "tenant-a"  # engines that publish it raw
    assert published_salt("tenant-a", SALT_TAG_HMAC) not in (keyed, salt_tag("tenant-a"))


def test_request_and_event_agree_on_a_keyed_salt(impl: types.SimpleNamespace) -> None:
    tokens = [5, 6, 7, 8]
    key = b"cluster-secret"
    event = Stored(block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=4,
                   extra_keys=[[salt_tag("tenant-a", key)]])
    request = _request_hashes(impl, tokens, salt=published_salt("tenant-a", SALT_TAG_HMAC, key))
    assert _event_hashes(impl, event) == request
    unkeyed = _request_hashes(impl, tokens, salt=published_salt("tenant-a", SALT_TAG_SHA256))
    assert unkeyed != request


def _image_event(uuid: str | None, version: int | None) -> Stored:
    tokens: list[int | str] = [1, DIGEST, DIGEST, DIGEST, DIGEST, 2, 3, 4]
    return Stored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens, block_size=4,
        mm_keys=[[MmItem(DIGEST, 0, uuid)], [MmItem(DIGEST, 3, uuid)]],
        trtllm_image_routing=None if version is None else {"version": version},
    )


def test_request_and_event_agree_on_images(impl: types.SimpleNamespace) -> None:
    tokens: list[int | str] = [1, DIGEST, DIGEST, DIGEST, DIGEST, 2, 3, 4]
    by_digest = _request_hashes(impl, tokens, mm=[[(DIGEST, 0)], [(DIGEST, 3)]])
    by_uuid = _request_hashes(impl, tokens, mm=[[("sku-001", 0)], [("sku-001", 3)]])
    assert by_digest != by_uuid
    # Routing version 1 with a UUID: the UUID is the identity.
    assert _event_hashes(impl, _image_event("sku-001", 1)) == by_uuid
    # No hint, or no promise about hints: the content digest is.
    assert _event_hashes(impl, _image_event(None, 1)) == by_digest
    assert _event_hashes(impl, _image_event("sku-001", None)) == by_digest
    # vLLM: placeholder ints in token_ids, [identifier, offset] pairs in extra_keys.
    placeholder = [1, 0, 0, 0, 0, 2, 3, 4]
    vllm = Stored(block_hashes=[1, 2], parent_block_hash=None, token_ids=placeholder,
                  block_size=4, extra_keys=[[[DIGEST, 0]], [[DIGEST, 3]]])
    assert _event_hashes(impl, vllm) == _request_hashes(
        impl, placeholder, mm=[[(DIGEST, 0)], [(DIGEST, 3)]])


def test_event_hash_input_rules() -> None:
    child = Stored(block_hashes=[9], parent_block_hash=5, token_ids=[1, 2, 3, 4], block_size=4,
                   lora_name="sql", extra_keys=[["sql", [DIGEST, 2], "tenant-salt"]])
    # A child takes its scope from its parent: no seed; the vLLM mm pair still applies.
    assert event_hash_input(child) == (None, [[(DIGEST, 2)]])
    images = Stored(block_hashes=[9], parent_block_hash=None, token_ids=[1, DIGEST, 3, 4],
                    block_size=4)
    with pytest.raises(UnhashableStore):
        event_hash_input(images)
