"""Image routing hints: bound, oversize UUIDs, conflicts."""

from __future__ import annotations

import pytest

from workers.cache.image_hints import MAX_UUID_BYTES, ImageHints

A, B, C = "a" * 64, "b" * 64, "c" * 64


def test_bounded_least_recently_used_first() -> None:
    hints = ImageHints(capacity=2)
    hints.observe(A, "uuid-a")
    hints.observe(B, "uuid-b")
    # A is looked up, so B is now the least recently used and makes room for C.
    assert hints.lookup(A) == "uuid-a"
    hints.observe(C, "uuid-c")
    assert (hints.lookup(A), hints.lookup(B), hints.lookup(C)) == ("uuid-a", None, "uuid-c")
    assert len(hints) == 2 and hints.evictions == 1


def test_unnamed_images_teach_nothing() -> None:
    hints = ImageHints()
    hints.observe(A, None)
    assert len(hints) == 0 and hints.lookup(A) is None


def test_uuid_size_bound_is_in_utf8_bytes() -> None:
    hints = ImageHints()
    # 256 bytes is the limit itself; "é" is 2 bytes, so 129 of them are over it.
    hints.observe(A, "x" * MAX_UUID_BYTES)
    hints.observe(B, "é" * 129)
    hints.observe(C, "x" * (MAX_UUID_BYTES + 1))
    assert hints.lookup(A) == "x" * MAX_UUID_BYTES
    assert hints.lookup(B) is None and hints.lookup(C) is None
    assert hints.oversize == 2
    # An oversize UUID does not disturb a hint already held.
    hints.observe(A, "y" * 300)
    assert hints.lookup(A) == "x" * MAX_UUID_BYTES


def test_conflict_makes_a_digest_ambiguous_until_forgotten() -> None:
    hints = ImageHints(capacity=2)
    hints.observe(A, "one")
    hints.observe(A, "one")  # the same name again is no conflict
    assert hints.lookup(A) == "one"
    hints.observe(A, "two")
    assert hints.lookup(A) is None and hints.conflicts == 1
    # Seeing either name again does not resolve it.
    hints.observe(A, "one")
    assert hints.lookup(A) is None and hints.conflicts == 1
    # Once forgotten (B and C push it out), the digest can be learned afresh.
    hints.observe(B, "b")
    hints.observe(C, "c")
    hints.observe(A, "two")
    assert hints.lookup(A) == "two"


def test_rejects_bad_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ImageHints(capacity=0)
