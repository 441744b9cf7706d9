"""Engine block keys: chaining, scope, images, and the wire name of a key."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from workers.cache.block_keys import (
    U64_MAX,
    ImageSegment,
    ImageSpan,
    Prompt,
    RequestBlocks,
    Scope,
    image_digest,
    salt_tag,
    wire_hash,
)


def keys(prompt: Prompt, block_size: int = 4) -> list[bytes]:
    blocks = RequestBlocks(prompt, block_size)
    return [blocks.block(i).key for i in range(blocks.num_full_blocks)]


def test_golden_keys() -> None:
    # Pinned values: a change here changes every worker's keys and must be deliberate.
    assert Scope().root_key.hex() == (
        "e66d62c9f9b74d13e1fa4c44cc2fbe91eded275521e2484fb9ce03bfad99dfac"
    )
    [k0] = keys(Prompt([1, 2, 3, 4]))
    assert k0.hex() == "aa8bf74be7e16a5ff5660da84fe6c272d33d5c3da7f2a7a5c51b1dd9d0b06073"
    assert len(k0) == 32
    assert wire_hash(k0) == 0xAA8BF74BE7E16A5F


def test_chain_and_partial_blocks() -> None:
    # 10 tokens in blocks of 4: two full blocks; the last 2 tokens have no key.
    blocks = RequestBlocks(Prompt(list(range(10))), 4)
    assert blocks.num_full_blocks == 2
    b0, b1 = blocks.block(0), blocks.block(1)
    assert b0.parent is None and b1.parent == b0.key
    assert b1.positions == (4, 5, 6, 7)
    with pytest.raises(ValueError, match="not full"):
        blocks.block(2)
    # The same tokens after a different first block get a different key: the key is chained.
    other = keys(Prompt([9, 9, 9, 9, 4, 5, 6, 7]))
    assert other[1] != b1.key
    # Two more tokens fill block 2.
    blocks.append([10, 11])
    assert blocks.block(2).parent == b1.key


def test_append_checks_every_token_first() -> None:
    blocks = RequestBlocks(Prompt([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="token id"):
        blocks.append([4, -1])
    assert blocks.num_tokens == 3


def test_scope_separates_keys() -> None:
    tokens = [1, 2, 3, 4]
    base = keys(Prompt(tokens))
    lora = keys(Prompt(tokens, scope=Scope(lora_id=1)))
    salt_int = keys(Prompt(tokens, scope=Scope(salt=1)))
    salt_str = keys(Prompt(tokens, scope=Scope(salt="1")))
    salt_empty = keys(Prompt(tokens, scope=Scope(salt="")))
    # Every scope is its own key space; 1 and "1", and "" and no salt, never collide.
    assert len({base[0], lora[0], salt_int[0], salt_str[0], salt_empty[0]}) == 5
    # The LoRA name is published, not keyed: the id decides reuse.
    assert keys(Prompt(tokens, scope=Scope(lora_id=1, lora_name="a"))) == lora


@pytest.mark.parametrize("salt", [2**63, 2**63 + 1, U64_MAX])
def test_salt_in_the_upper_half_of_u64(salt: int) -> None:
    # A salt of 2**63 or more is a valid unsigned 64-bit value, distinct from its neighbours.
    assert keys(Prompt([1, 2, 3, 4], scope=Scope(salt=salt))) != keys(
        Prompt([1, 2, 3, 4], scope=Scope(salt=salt - 1))
    )


@pytest.mark.parametrize(
    ("scope", "message"),
    [
        (dict(salt=2**64), "salt must be in"),
        (dict(salt=-1), "salt must be in"),
        (dict(salt=True), "salt must be an int"),
        (dict(salt=1.5), "salt must be str or int"),
        (dict(lora_id=2**64), "lora_id must be in"),
        (dict(lora_name="a"), "lora_name needs a lora_id"),
    ],
)
def test_scope_rejects(scope: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Scope(**scope)  # type: ignore[arg-type]


def test_published_scope_never_shows_the_salt() -> None:
    tag = "salt:" + hashlib.sha256(b"tenant-a").hexdigest()[:16]
    assert salt_tag("tenant-a") == tag
    assert Scope(lora_id=7, lora_name="sql", salt="tenant-a").published_keys() == ["sql", tag]
    assert Scope(salt=2**63).published_keys() == [salt_tag(str(2**63))]
    assert Scope(lora_id=7).published_keys() is None
    keyed = "salt:" + hmac.new(b"cluster", b"tenant-a", hashlib.sha256).hexdigest()[:16]
    assert Scope(salt="tenant-a").published_keys(b"cluster") == [keyed] != [tag]


def test_image_digest() -> None:
    assert image_digest(b"abc", None) == hashlib.sha256(b"abc").hexdigest()
    # With a UUID the digest covers UUID and content: neither alone decides it.
    named = image_digest(b"abc", "img-1")
    assert named != image_digest(b"abc", None)
    assert named != image_digest(b"abd", "img-1")
    assert named != image_digest(b"abc", "img-2")


def test_image_positions_and_segments() -> None:
    cat = image_digest(b"cat", "u1")
    # Tokens 0..9; the image takes positions 2..7 (6 positions) across blocks 0 and 1.
    prompt = Prompt(list(range(10)), (ImageSpan(2, 6, cat, "u1"),))
    assert prompt.positions() == [0, 1, cat, cat, cat, cat, cat, cat, 8, 9]
    blocks = RequestBlocks(prompt, 4)
    b0, b1 = blocks.block(0), blocks.block(1)
    assert b0.positions == (0, 1, cat, cat)
    assert b0.images == (ImageSegment(cat, 0, "u1"),)
    assert b1.positions == (cat, cat, cat, cat)
    assert b1.images == (ImageSegment(cat, 2, "u1"),)
    # The placeholder ids do not enter the key: only the digest does.
    same = Prompt([0, 1, 77, 77, 77, 77, 77, 77, 8, 9], (ImageSpan(2, 6, cat, "u1"),))
    assert keys(same) == keys(prompt)


def test_same_uuid_different_content_gets_different_keys() -> None:
    cat = Prompt([0] * 8, (ImageSpan(0, 8, image_digest(b"cat", "u1"), "u1"),))
    dog = Prompt([0] * 8, (ImageSpan(0, 8, image_digest(b"dog", "u1"), "u1"),))
    assert keys(cat)[0] != keys(dog)[0]
    # And an image never keys like text.
    assert keys(cat)[0] != keys(Prompt([0] * 8))[0]


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([ImageSpan(2, 4, "ab", None)], "64 lowercase hex"),
        ([ImageSpan(2, 4, None, None)], "64 lowercase hex"),
        ([ImageSpan(6, 4, "a" * 64, None)], "outside"),
        ([ImageSpan(0, 4, "a" * 64, None), ImageSpan(3, 2, "b" * 64, None)], "overlaps"),
        ([ImageSpan(0, 0, "a" * 64, None)], "overlaps"),
    ],
)
def test_prompt_rejects_bad_images(images: list[ImageSpan], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Prompt(list(range(8)), images)


def test_prompt_rejects_bad_tokens() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        Prompt([])
    with pytest.raises(ValueError, match="token ids"):
        Prompt([1, -2])
    with pytest.raises(ValueError, match="token ids must be ints"):
        Prompt([1, "2"])  # type: ignore[list-item]
