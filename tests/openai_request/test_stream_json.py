"""The incremental JSON object reader: the same object as ``json.loads`` however the bytes are
split, a partial view that is always a prefix of the final one, and a clear error (never a
wrong object) for anything that is not a JSON object it takes."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from openai_request.stream_json import ObjectReader, StreamError

NESTED = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "caf\u00e9 \u2603 \U0001f600 \"quoted\" back\\slash \t tab"},
        {"role": "user", "content": [
            {"type": "text", "text": "a\u0000b \ud7ff \ue000 / \u00ff"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": ""}]},
    ],
    "max_tokens": 16, "temperature": -1.5e-3, "stream": True, "stop": None, "n": 0,
    "empty": {}, "none": [], "deep": [[[{"a": [1, [2, {"b": "c"}]]}]]],
}


def encodings(value: Any) -> list[bytes]:
    """The same object written with escapes and with raw UTF-8, compact and spaced."""
    return [json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode(),
            json.dumps(value, indent=2, ensure_ascii=False).encode(),
            json.dumps(value, separators=(",", ":")).encode()]


def read(chunks: list[bytes]) -> ObjectReader:
    reader = ObjectReader()
    for chunk in chunks:
        reader.feed(chunk)
    return reader


def is_prefix(partial: Any, final: Any) -> bool:
    """Whether ``partial`` is ``final`` cut short: strings by prefix, containers by their
    elements (the last may itself be cut), scalars equal."""
    if isinstance(partial, str):
        return isinstance(final, str) and final.startswith(partial)
    if isinstance(partial, dict):
        return isinstance(final, dict) and all(
            k in final and is_prefix(v, final[k]) for k, v in partial.items())
    if isinstance(partial, list):
        return (isinstance(final, list) and len(partial) <= len(final)
                and all(is_prefix(p, f) for p, f in zip(partial, final, strict=False)))
    return bool(partial == final)


@pytest.mark.parametrize("raw", encodings(NESTED))
def test_every_split_in_two_reads_the_same_object(raw: bytes) -> None:
    expected = json.loads(raw)
    for cut in range(len(raw) + 1):
        reader = ObjectReader()
        reader.feed(raw[:cut])
        partial = reader.partial()
        assert is_prefix(partial, expected), cut
        reader.feed(raw[cut:])
        assert reader.done and reader.members == expected and reader.partial() == expected


@pytest.mark.parametrize("raw", encodings(NESTED))
def test_byte_by_byte_the_partial_only_grows(raw: bytes) -> None:
    expected = json.loads(raw)
    reader, before = ObjectReader(), json.dumps({})
    for i in range(len(raw)):
        reader.feed(raw[i:i + 1])
        partial = reader.partial()
        assert is_prefix(partial, expected), i
        now = json.dumps(partial)
        assert len(now) >= len(before) - 8 or reader.done  # a closed-over cut never shrinks much
        before = now
    assert reader.members == expected


def test_an_open_string_never_shows_half_an_escape_or_character() -> None:
    raw = b'{"model": "m", "prompt": "ab\\u00e9\\ud83d\\ude00\xc3\xa9\\n\\\\u0041z"}'
    final = json.loads(raw)["prompt"]
    seen = []
    for cut in range(raw.index(b'"ab') + 1, len(raw)):
        reader = ObjectReader()
        reader.feed(raw[:cut])
        prompt = reader.partial().get("prompt", "")
        assert final.startswith(prompt), (cut, prompt)
        assert "\ud83d" not in prompt  # a lone high surrogate waits for its low half
        seen.append(prompt)
    assert seen[-1] == final  # just before the closing brace: the whole string
    # The escaped backslash before "u0041" is a backslash and the letters, never an escape.
    assert final.endswith("\\u0041z")
    assert "ab\u00e9" in seen and "ab\u00e9\U0001f600" in seen and "ab" in seen


def test_the_open_key_is_the_member_being_read() -> None:
    reader = ObjectReader()
    reader.feed(b'{"model": "m", "prom')
    assert reader.open_key is None and reader.members == {"model": "m"}
    reader.feed(b'pt": "long')
    assert reader.open_key == "prompt" and reader.partial() == {"model": "m", "prompt": "long"}
    reader.feed(b' text", "max_tokens": 1')  # a number may go on in the next chunk
    assert reader.members == {"model": "m", "prompt": "long text"}
    reader.feed(b"2}")
    assert reader.members["max_tokens"] == 12 and reader.done and reader.open_key is None


def test_a_long_string_in_small_chunks_is_read_whole() -> None:
    text = "".join(random.Random(5).choice("ab c\u00e9\U0001f600\"\\\n") for _ in range(200_000))
    raw = json.dumps({"model": "m", "prompt": text}).encode()
    reader = ObjectReader()
    for i in range(0, len(raw), 1000):
        reader.feed(raw[i:i + 1000])
        if i % 50_000 < 1000:
            assert text.startswith(reader.partial().get("prompt", ""))
    assert reader.members["prompt"] == text


@pytest.mark.parametrize("raw", [
    b"[1, 2]", b'"text"', b"12", b"null", b"  x", b'{"a" 1}', b'{"a": 1,}', b'{"a": 1 "b": 2}',
    b'{"a": [1,]}', b'{"a": [1 2]}', b'{1: 2}', b'{"a": tru}', b'{"a": 01}', b'{"a": "\x01"}',
    b'{"a": "\\x"}', b'{"a": "\\u12g4"}', b'{"a": "\xff\xfe"}', b'{"a": 1} {"b": 2}',
    b'{"a": 1}]', b'{"a": 1, "a": 2}', b'{"a": }', b'{"a": [}', b'{"a": {"b": 1]}',
    b"{" + b'"a": [' * 70 + b"]" * 70 + b"}",
])
def test_what_is_not_an_object_it_takes_is_an_error(raw: bytes) -> None:
    for chunks in ([raw], [raw[i:i + 1] for i in range(len(raw))]):
        with pytest.raises(StreamError):
            read(chunks)


def test_random_objects_and_random_damage_against_json_loads() -> None:
    rng = random.Random(11)

    def value(depth: int) -> Any:
        pick = rng.randrange(8 if depth < 4 else 4)
        if pick == 0:
            return rng.choice([None, True, False, 0, -7, 3.25, 1e300, "", "\\", '"'])
        if pick in (1, 2, 3):
            return "".join(rng.choice("ab \u00e9\u2603\U0001f600\"\\\n\t/\x00")
                           for _ in range(rng.randrange(12)))
        if pick in (4, 5):
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {f"k{i}{rng.random()}": value(depth + 1) for i in range(rng.randrange(4))}

    agreed = refused = 0
    for _ in range(400):
        obj = {f"m{i}": value(1) for i in range(rng.randrange(1, 5))}
        raw = rng.choice(encodings(obj))
        if rng.random() < 0.5:  # damage one byte
            at = rng.randrange(len(raw))
            raw = raw[:at] + bytes([rng.choice(b'{}[]",:\\ 0aeu\xc3\xff')]) + raw[at + 1:]
        cuts = sorted(rng.sample(range(len(raw) + 1), min(len(raw) + 1, 6)))
        chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
        try:
            expected = json.loads(raw)
        except ValueError:
            expected = None
        try:
            reader = read(chunks)
        except StreamError:
            # json.loads takes what the reader refuses only with a repeated top-level key
            if isinstance(expected, dict):
                pairs = json.loads(raw, object_pairs_hook=lambda p: p)
                assert len({k for k, _ in pairs}) < len(pairs)
            refused += 1
            continue
        if reader.done:
            assert reader.members == expected
            agreed += 1
        else:  # the bytes ended inside the object
            assert expected is None
    assert agreed > 150 and refused > 50
