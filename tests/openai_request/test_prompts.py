"""Request bodies to prompt tokens: exact ids, image spans, and each bad body's 400 reason."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest

from openai_request.images import ImageSpan, image_digest
from openai_request.prompts import PromptTokens, build_prompt
from openai_request.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from tests.fixtures.tokenizer_files import write_tiny_tokenizer

BYTES = ByteTokenizer()
PNG = b"\x89PNG\r\n\x1a\n-fake-image"
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
REMOTE = b"remote-image-bytes"


def ids(text: str) -> list[int]:
    return [b + 4 for b in text.encode()]


def build(body: Any, kind: str = "chat", tokenizer: Tokenizer = BYTES, **kw: Any) -> PromptTokens:
    kw.setdefault("mm_tokens_per_image", 3)
    kw.setdefault("max_image_bytes", 1000)
    kw.setdefault("fetch", None)
    return build_prompt(body, kind, tokenizer, **kw)  # type: ignore[arg-type]


def image_chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


# --- completions ---------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Hi", ["Hi"]])
def test_completion_text_gets_bos(prompt: Any) -> None:
    p = build({"model": "m", "prompt": prompt}, "completions")
    assert p == PromptTokens(token_ids=[1, 76, 109], images=[], cache_salt=None, model="m")


@pytest.mark.parametrize("prompt", [[5, 6, 259], [[5, 6, 259]]])
def test_completion_token_ids_taken_as_is(prompt: Any) -> None:
    assert build({"prompt": prompt}, "completions").token_ids == [5, 6, 259]


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        (["a", "b"], "one prompt per request: prompt holds several prompts"),
        ([[1], [2]], "one prompt per request: prompt holds several prompts"),
        ("", "prompt must not be empty"),
        ([], "prompt must not be empty"),
        ([[]], "prompt must not be empty"),
        (7, "prompt must be a string, a list of token ids, or a list holding one of those"),
        ([1, "a"], "prompt must be a string, a list of token ids, or a list holding one of those"),
        ([1, True], "prompt must be a string, a list of token ids, or a list holding one of those"),
        ([1.0], "prompt must be a string, a list of token ids, or a list holding one of those"),
        (
            [[1, None]],
            "prompt must be a string, a list of token ids, or a list holding one of those",
        ),
        ([4, 260], "prompt token id 260 at index 1 is out of range [0, 260)"),
        ([-1], "prompt token id -1 at index 0 is out of range [0, 260)"),
    ],
)
def test_bad_completion_prompts(prompt: Any, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        build({"prompt": prompt}, "completions")
    assert str(info.value) == reason


def test_completion_scope_fields() -> None:
    p = build({"model": "lora-a", "prompt": [5], "cache_salt": "tenant-1"}, "completions")
    assert (p.model, p.cache_salt) == ("lora-a", "tenant-1")


# --- chat ----------------------------------------------------------------------------------


def test_chat_byte_tokenizer_exact_ids() -> None:
    p = build({"messages": [{"role": "user", "content": "Hi"}]})
    assert p.token_ids == ids("<|user|>\nHi<|end|>\n<|assistant|>\n")
    p = build({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False})
    assert p.token_ids == ids("<|user|>\nHi<|end|>\n")


def test_chat_images_expand_to_placeholders() -> None:
    body = image_chat(text_part("A"), image_part(PNG_URL), image_part(PNG_URL, uuid="u2"))
    p = build(body)
    head = ids("<|user|>\nA\n")
    assert p.token_ids == [*head, 3, 3, 3, *ids("\n"), 3, 3, 3, *ids("<|end|>\n<|assistant|>\n")]
    digest = hashlib.sha256(PNG).hexdigest()
    with_uuid = image_digest(PNG, "u2")
    assert p.images == [
        ImageSpan(start=len(head), length=3, digest=digest, uuid=None),
        ImageSpan(start=len(head) + 4, length=3, digest=with_uuid, uuid="u2"),
    ]
    assert p.matchable_tokens() == len(p.token_ids)


def test_router_and_worker_agree_on_ids(tmp_path: Path) -> None:
    """The router cannot fetch a remote image; its ids still equal the worker's."""
    tok = load_tokenizer(str(write_tiny_tokenizer(tmp_path)))
    body = image_chat(
        text_part("what is in this image?"),
        image_part(PNG_URL),
        image_part("https://img.example/cat.png", uuid="cat"),
        text_part("describe the picture"),
    )
    router = build(body, tokenizer=tok, fetch=lambda url: None)
    worker = build(body, tokenizer=tok, fetch=lambda url: REMOTE)
    assert router.token_ids == worker.token_ids
    assert router.token_ids[0] == tok.bos_token_id  # written by the template
    assert [s.start for s in router.images] == [s.start for s in worker.images]
    assert all(
        router.token_ids[i] == tok.image_token_id
        for s in router.images
        for i in range(s.start, s.end)
    )
    assert router.images[0] == worker.images[0]
    remote_router, remote_worker = router.images[1], worker.images[1]
    assert remote_router.digest is None and remote_router.uuid == "cat"
    assert remote_worker.digest == image_digest(REMOTE, "cat")
    # The router's lookup stops at the image it cannot identify, unless UUIDs may stand in.
    assert router.matchable_tokens() == remote_router.start
    assert router.matchable_tokens(by_uuid=True) == len(router.token_ids)
    assert worker.matchable_tokens() == len(worker.token_ids)


def test_unresolved_image_without_uuid_stops_matching_even_by_uuid() -> None:
    p = build(image_chat(text_part("x"), image_part("http://h/a.png")))
    assert p.images[0].digest is None
    assert p.matchable_tokens(by_uuid=True) == p.images[0].start


@pytest.mark.parametrize("uuids", [["a", None], {"image": ["a", None]}])
def test_body_uuid_list(uuids: Any) -> None:
    body = image_chat(image_part(PNG_URL), image_part(PNG_URL, uuid="b"))
    body["mm_uuids"] = uuids
    assert [s.uuid for s in build(body).images] == ["a", "b"]


@pytest.mark.parametrize(
    ("uuids", "reason"),
    [
        (["a"], "UUID list does not match the images: 1 UUIDs for 2 images"),
        (["a", "b", "c"], "UUID list does not match the images: 3 UUIDs for 2 images"),
        ("a", "mm_uuids must be a list of strings or nulls, one per image"),
        ({"video": []}, "mm_uuids must be a list of strings or nulls, one per image"),
        (["a", 3], "mm_uuids[1] must be a non-empty string or null"),
        (["a", ""], "mm_uuids[1] must be a non-empty string or null"),
        ([None, "c"], "image 1 has two different UUIDs (mm_uuids and its part)"),
    ],
)
def test_bad_body_uuid_list(uuids: Any, reason: str) -> None:
    body = image_chat(image_part(PNG_URL), image_part(PNG_URL, uuid="b"))
    body["mm_uuids"] = uuids
    with pytest.raises(ValueError) as info:
        build(body)
    assert str(info.value) == reason


def test_uuid_list_on_completions_must_be_empty() -> None:
    assert build({"prompt": [5], "mm_uuids": []}, "completions").images == []
    with pytest.raises(ValueError, match=r"^UUID list does not match the images: 1 UUIDs for 0"):
        build({"prompt": [5], "mm_uuids": ["a"]}, "completions")


@pytest.mark.parametrize(
    ("url", "fetched", "reason"),
    [
        ("file:///etc/passwd", None, "image 0: URL must be a data: URL or an http(s) URL"),
        ("ftp://h/a.png", None, "image 0: URL must be a data: URL or an http(s) URL"),
        (
            "data:text/plain,hi",
            None,
            "image 0: data: URL media type text/plain is not an image type",
        ),
        ("data:image/png," + "a" * 11, None, "image 0: image is larger than 10 bytes"),
        ("https://h/a.png", b"x" * 11, "image 0: image is larger than 10 bytes"),
        ("https://h/a.png", b"", "image 0: image is empty"),
    ],
)
def test_bad_images(url: str, fetched: bytes | None, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        build(image_chat(image_part(url)), max_image_bytes=10, fetch=lambda u: fetched)
    assert str(info.value) == reason


def test_fetch_gets_the_url_and_only_for_remote_images() -> None:
    asked: list[str] = []

    def fetch(url: str) -> bytes:
        asked.append(url)
        return REMOTE

    build(image_chat(image_part(PNG_URL), image_part("https://h/a.png")), fetch=fetch)
    assert asked == ["https://h/a.png"]


def test_template_that_drops_images_is_caught(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path, chat_template="{{ messages[0]['role'] }}")
    tok = load_tokenizer(str(tmp_path))
    with pytest.raises(
        ValueError, match=r"^the chat template rendered 0 image markers for 1 images$"
    ):
        build(image_chat(image_part(PNG_URL)), tokenizer=tok)


@pytest.mark.parametrize(
    ("kind", "body", "reason"),
    [
        ("chat", [], "request body must be a JSON object"),
        ("chat", {}, "messages is required"),
        ("chat", {"messages": []}, "messages must be a non-empty list"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"},
            "add_generation_prompt must be a boolean",
        ),
        ("completions", {}, "prompt is required"),
        ("completions", {"prompt": [5], "model": 3}, "model must be a string"),
        ("completions", {"prompt": [5], "cache_salt": ""}, "cache_salt must be a non-empty string"),
        ("completions", {"prompt": [5], "cache_salt": 9}, "cache_salt must be a non-empty string"),
    ],
)
def test_bad_bodies(kind: str, body: Any, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        build(body, kind)
    assert str(info.value) == reason


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"^kind must be 'completions' or 'chat', got 'embed'$"):
        build({"prompt": [5]}, "embed")
    with pytest.raises(ValueError, match=r"^mm_tokens_per_image must be at least 1, got 0$"):
        build({"prompt": [5]}, "completions", mm_tokens_per_image=0)
    with pytest.raises(ValueError, match=r"^max_image_bytes must be at least 1, got 0$"):
        build({"prompt": [5]}, "completions", max_image_bytes=0)
