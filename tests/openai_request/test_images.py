"""Image data URLs, content digests and placeholder positions."""

from __future__ import annotations

import base64
import dataclasses
import hashlib

import pytest

from openai_request.images import (
    ImageSpan,
    decode_data_url,
    image_digest,
    image_format,
    splice_images,
)

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
PNG_B64 = base64.b64encode(PNG).decode()


def test_decode_base64_data_url() -> None:
    assert decode_data_url(f"data:image/png;base64,{PNG_B64}", 1000) == PNG
    # Parameters before ";base64", upper-case scheme and type, wrapped lines, missing padding.
    wrapped = "\n".join(PNG_B64[i : i + 10] for i in range(0, len(PNG_B64), 10)).rstrip("=")
    url = f"DATA:IMAGE/PNG;name=a.png;base64,{wrapped}"
    assert decode_data_url(url, 1000) == PNG


def test_decode_percent_encoded_data_url() -> None:
    assert decode_data_url("data:image/gif,GIF89a%00%FFab", 10) == b"GIF89a\x00\xffab"
    assert decode_data_url("data:image/bmp,BM%00%FF", 4) == b"BM\x00\xff"


def test_size_limit_is_inclusive() -> None:
    assert decode_data_url(f"data:image/png;base64,{PNG_B64}", len(PNG)) == PNG
    with pytest.raises(ValueError) as info:
        decode_data_url(f"data:image/png;base64,{PNG_B64}", len(PNG) - 1)
    assert str(info.value) == f"image is larger than {len(PNG) - 1} bytes"
    with pytest.raises(ValueError, match=r"^image is larger than 3 bytes$"):
        decode_data_url("data:image/x-raw,abcd", 3)


def test_oversized_base64_is_refused_before_decoding() -> None:
    # Not valid base64 at all, but far too long: the size check comes first.
    with pytest.raises(ValueError, match=r"^image is larger than 10 bytes$"):
        decode_data_url("data:image/png;base64," + "*" * 10_000, 10)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://x/a.png", "image URL is not a data: URL"),
        ("data:image/png;base64", "data: URL has no ',' before its payload"),
        ("data:text/plain;base64,aGk=", "data: URL media type text/plain is not an image type"),
        ("data:;base64,aGk=", "data: URL media type text/plain (the default) is not an image type"),
        ("data:,hi", "data: URL media type text/plain (the default) is not an image type"),
        ("data:image/;base64,aGk=", "data: URL media type image/ is not an image type"),
        ("data:image/png;base64,a*Gk", "data: URL payload is not valid base64"),
        ("data:image/png;base64,Q", "data: URL payload is not valid base64"),
        ("data:image/png;base64,", "data: URL image is empty"),
        ("data:image/png,", "data: URL image is empty"),
    ],
)
def test_bad_data_urls(url: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        decode_data_url(url, 1000)
    assert str(info.value) == reason


def test_max_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"^max_bytes must be at least 1, got 0$"):
        decode_data_url("data:image/png,a", 0)


def test_digest_without_uuid_is_sha256_of_bytes() -> None:
    assert image_digest(PNG, None) == hashlib.sha256(PNG).hexdigest()


def _uuid_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32, person=b"kvroute-uuid-img").hexdigest()


def test_digest_with_uuid_is_length_prefixed() -> None:
    assert image_digest(PNG, "cat") == _uuid_digest(b"\x00" * 7 + b"\x03" + b"cat" + PNG)
    # UTF-8 length, not characters: "é" is 2 bytes.
    assert image_digest(b"x", "é") == _uuid_digest(b"\x00" * 7 + b"\x02" + "é".encode() + b"x")


def test_a_plain_image_cannot_forge_a_uuid_digest() -> None:
    forged = b"\x00" * 7 + b"\x03" + b"cat" + PNG  # the bytes the UUID rule hashes
    assert image_digest(forged, None) != image_digest(PNG, "cat")


def test_digest_rules() -> None:
    other = PNG + b"!"
    # The same UUID over different content never shares a digest.
    assert image_digest(PNG, "cat") != image_digest(other, "cat")
    # A UUID changes the digest, and different UUIDs differ.
    assert image_digest(PNG, "cat") != image_digest(PNG, None)
    assert image_digest(PNG, "cat") != image_digest(PNG, "dog")
    # The length prefix keeps UUID and content apart: ("ab", "c...") vs ("a", "bc...").
    assert image_digest(b"c" + PNG, "ab") != image_digest(b"bc" + PNG, "a")
    assert len(image_digest(PNG, None)) == 64


def test_splice_images() -> None:
    ids, starts = splice_images([[10, 11], [12], []], 3, 7)
    assert ids == [10, 11, 7, 7, 7, 12, 7, 7, 7]
    assert starts == [2, 6]
    assert splice_images([[5]], 3, 7) == ([5], [])
    with pytest.raises(ValueError, match=r"^mm_tokens_per_image must be at least 1, got 0$"):
        splice_images([[1], [2]], 0, 7)


def test_image_span_is_frozen() -> None:
    span = ImageSpan(start=4, length=3, digest=None, uuid="u")
    assert span.end == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        span.start = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(),
        "data:image/svg+xml,%3Csvg%2F%3E",
        "data:image/png," + "x" * 40,
    ],
)
def test_inline_bytes_that_are_not_an_image_are_refused(url: str) -> None:
    # The same magic-byte check a fetched image gets: a media type alone proves nothing.
    with pytest.raises(ValueError) as info:
        decode_data_url(url, 1000)
    assert str(info.value) == "data: URL payload is not an image (no known format's magic bytes)"


def test_image_format_by_magic_bytes() -> None:
    assert image_format(PNG) == "png"
    assert image_format(b"\xff\xd8\xff\xe0" + b"\0" * 8) == "jpeg"
    assert image_format(b"RIFF\0\0\0\0WEBPVP8 ") == "webp"
    assert image_format(b"\x89PNG") is None  # a truncated signature is not one
    assert image_format(b"") is None
