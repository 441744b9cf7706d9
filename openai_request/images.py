"""Image parts of a prompt: inline data, content digests and placeholder positions.

An image occupies ``mm_tokens_per_image`` consecutive positions of a prompt, each holding the
tokenizer's image placeholder id. What identifies the image, for cache reuse and for routing, is
its content digest (:func:`image_digest`), which the KV events carry at those positions.

This module does no I/O. Inline ``data:`` URLs are decoded here (:func:`decode_data_url`);
``http(s)`` URLs are fetched, with limits, by the worker's HTTP layer, which hands the bytes to
:func:`openai_request.prompts.build_prompt` through its ``fetch`` callable. The router cannot fetch,
so an image it cannot identify ends the part of the prompt it can match
(:meth:`openai_request.prompts.PromptTokens.matchable_tokens`).

Digest rules:
    1. Without a caller UUID: the hex SHA-256 of the image bytes.
    2. With a caller UUID: the hex BLAKE2b-256, personalised ``kvroute-uuid-img``, of the
       UUID's UTF-8 length (8 bytes, big-endian), the UUID's UTF-8 bytes, then the image bytes.
       The same UUID over different bytes gives different digests, so a reused or forged UUID
       never makes two images share KV; the digest is never derived from the UUID alone.
       A different function from rule 1 on purpose: were both SHA-256, anyone who knows an
       image's bytes and UUID could submit the bytes ``length || uuid || image`` as a plain
       image and collide with it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

__all__ = [
    "IMAGE_MARKER",
    "ImageSpan",
    "decode_data_url",
    "image_digest",
    "image_format",
    "splice_images",
]

#: What a chat message's image part becomes in rendered text, before tokenization splits the
#: text there. Callers' text may not contain it.
IMAGE_MARKER = "<|image|>"


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Where one image sits in a prompt's token ids and what identifies it.

    Attributes:
        start: index of its first placeholder position.
        length: number of placeholder positions (``mm_tokens_per_image``).
        digest: hex content digest (see the module docstring), or ``None`` when the image's
            bytes were not available (the router never fetches remote images).
        uuid: the caller's UUID for the image, or ``None``.
    """

    start: int
    length: int
    digest: str | None
    uuid: str | None

    @property
    def end(self) -> int:
        """Index one past its last placeholder position."""
        return self.start + self.length


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """Return the bytes of an image ``data:`` URL (RFC 2397).

    Args:
        url: ``data:image/<subtype>[;params][;base64],<data>``.
        max_bytes: largest accepted decoded size.

    Returns:
        The decoded bytes (at least one byte).

    Raises:
        ValueError: the URL is not a data URL, its media type is not ``image/*``, its payload
            is not valid base64 or percent-encoding, it is empty, or it decodes to more than
            ``max_bytes`` bytes, or its bytes are not an image by their magic bytes
            (:func:`image_format`). The message says which.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
    if url[:5].lower() != "data:":
        raise ValueError("image URL is not a data: URL")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ValueError("data: URL has no ',' before its payload")
    params = header.split(";")
    media_type = params[0].strip().lower()
    is_base64 = len(params) > 1 and params[-1].strip().lower() == "base64"
    if not media_type.startswith("image/") or len(media_type) == len("image/"):
        shown = media_type or "text/plain (the default)"
        raise ValueError(f"data: URL media type {shown} is not an image type")
    if is_base64:
        data = _decode_base64(payload, max_bytes)
    else:
        if len(payload) // 3 > max_bytes:  # each byte takes 1 to 3 characters
            raise ValueError(f"image is larger than {max_bytes} bytes")
        data = unquote_to_bytes(payload)
    if not data:
        raise ValueError("data: URL image is empty")
    if len(data) > max_bytes:
        raise ValueError(f"image is larger than {max_bytes} bytes")
    if image_format(data) is None:
        raise ValueError("data: URL payload is not an image (no known format's magic bytes)")
    return data


# (offset, magic bytes, format name); WebP and the ISO media formats also check a brand.
_MAGIC = (
    (0, b"\x89PNG\r\n\x1a\n", "png"),
    (0, b"\xff\xd8\xff", "jpeg"),
    (0, b"GIF87a", "gif"),
    (0, b"GIF89a", "gif"),
    (0, b"BM", "bmp"),
    (0, b"II*\x00", "tiff"),
    (0, b"MM\x00*", "tiff"),
    (0, b"\x00\x00\x01\x00", "ico"),
)
_ISO_BRANDS = {b"avif": "avif", b"avis": "avif", b"heic": "heic", b"heix": "heic",
               b"mif1": "heif", b"msf1": "heif"}


def image_format(data: bytes) -> str | None:
    """Return the image format ``data`` starts as (``"png"``, ``"jpeg"``, ...), or None.

    Recognised: PNG, JPEG, GIF, WebP, BMP, TIFF, ICO, AVIF and HEIF/HEIC, by magic bytes. Inline
    images (:func:`decode_data_url`) and fetched ones (the worker's HTTP layer) both pass it.
    """
    for offset, magic, name in _MAGIC:
        if data[offset:offset + len(magic)] == magic:
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[4:8] == b"ftyp":
        return _ISO_BRANDS.get(data[8:12])
    return None


def _decode_base64(payload: str, max_bytes: int) -> bytes:
    # Whitespace (line-wrapped base64) and percent-encoding of the payload are tolerated, as
    # browsers do; anything else outside the alphabet is an error rather than silently skipped.
    raw = unquote_to_bytes("".join(payload.split())) if "%" in payload else payload.encode()
    raw = b"".join(raw.split())
    # Refuse before decoding: 4 characters carry 3 bytes.
    if (len(raw) // 4) * 3 - 2 > max_bytes:
        raise ValueError(f"image is larger than {max_bytes} bytes")
    # Missing padding is tolerated too; validate=True rejects characters outside the alphabet.
    raw += b"=" * (-len(raw) % 4)
    try:
        return base64.b64decode(raw, validate=True)
    except binascii.Error as e:
        raise ValueError("data: URL payload is not valid base64") from e


def image_digest(content: bytes, uuid: str | None) -> str:
    """Return the hex content digest of an image (rules in the module docstring).

    Args:
        content: the image bytes.
        uuid: the caller's UUID for the image, or ``None``.

    Returns:
        64 lowercase hex digits.
    """
    if uuid is None:
        return hashlib.sha256(content).hexdigest()
    u = uuid.encode("utf-8")
    h = hashlib.blake2b(digest_size=32, person=_UUID_PERSON)
    h.update(len(u).to_bytes(8, "big"))
    h.update(u)
    h.update(content)
    return h.hexdigest()


_UUID_PERSON = b"kvroute-uuid-img"


def splice_images(
    segments: list[list[int]], mm_tokens_per_image: int, image_token_id: int
) -> tuple[list[int], list[int]]:
    """Join token segments with an image's placeholder positions between each two.

    Args:
        segments: token ids of the text before the first image, between images, and after the
            last one (``n + 1`` segments for ``n`` images).
        mm_tokens_per_image: positions each image occupies.
        image_token_id: the placeholder id.

    Returns:
        The joined token ids and the start index of each image.

    Raises:
        ValueError: ``mm_tokens_per_image`` is below 1.
    """
    if mm_tokens_per_image < 1:
        raise ValueError(f"mm_tokens_per_image must be at least 1, got {mm_tokens_per_image}")
    ids: list[int] = []
    starts: list[int] = []
    for i, seg in enumerate(segments):
        if i:
            starts.append(len(ids))
            ids.extend([image_token_id] * mm_tokens_per_image)
        ids.extend(seg)
    return ids, starts
