"""A JSON object that repeats a key is refused (400 naming the key), at the top level and in
every object below it: the router reads a body with one decoder and each engine with its
own, and two readers of a repeated key may take different values (vLLM's, like the router's
msgspec, the last; others the first; the router's early reader, which decides before the
body ends, the first it sees), so the router would route or refuse on one value while the
engine serves another."""

from __future__ import annotations

import json
import random

import pytest

from openai_request.bodies import ApiError, parse_body

REPEATS = {
    "model": b'{"model": "a", "prompt": "hi", "model": "b"}',
    "prompt": b'{"prompt": "hi", "model": "a", "prompt": "there"}',
    "cache_salt": b'{"prompt": "hi", "cache_salt": "x", "cache_salt": "y"}',
    "priority": b'{"prompt": "hi", "priority": 0, "priority": -5}',
    "messages": b'{"messages": [], "model": "a", "messages": [{"role": "user"}]}',
    "content": b'{"messages": [{"role": "user", "content": "a", "content": "b"}]}',
    "role": b'{"messages": [{"role": "user", "content": "a", "role": "system"}]}',
    "text": b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a",'
            b' "text": "b"}]}]}',
    "escaped model": b'{"model": "a", "prompt": "hi", "mod\\u0065l": "b"}',
    "kv_transfer_params": b'{"prompt": "hi", "kv_transfer_params": null,'
                          b' "kv_transfer_params": {"do_remote_prefill": true}}',
}


@pytest.mark.parametrize("raw", REPEATS.values(), ids=REPEATS.keys())
def test_a_repeated_key_is_refused(raw: bytes) -> None:
    with pytest.raises(ApiError) as refused:
        parse_body(raw)
    assert refused.value.status == 400
    assert "repeat" in refused.value.message


def test_the_refusal_names_the_key() -> None:
    with pytest.raises(ApiError) as refused:
        parse_body(REPEATS["escaped model"])
    assert "'model'" in refused.value.message


@pytest.mark.parametrize("raw", [
    b'{"prompt": "a", "model": "m", "extra": {"model": "n"}}',  # the same key, two objects
    b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
    b'{"prompt": "\\"model\\": 1, \\"model\\": 2"}',  # keys inside a string are text
])
def test_the_same_key_in_different_objects_is_fine(raw: bytes) -> None:
    assert parse_body(raw)


# Each would pass a count of colons against keys that ignored the strings' colons, their
# escapes, or the values past what the count visits.
@pytest.mark.parametrize("raw", [
    b'{"a": "x:y", "a": "z"}',  # the dropped value's colon
    b'{"a": "\\u003a", "b": 1, "b": 2}',  # an escaped colon the size of the repeat
    b'{"a:b": 1, "a:b": 2}',  # colons in the repeated key
    b'{"prompt": [' + b", ".join(b"1" for _ in range(2000)) + b'], "prompt": "x"}',
    b'{"a": ' + b"[" * 700 + b"]" * 700 + b', "a": 1}',
])
def test_a_repeat_is_found_past_colons_in_strings_escapes_and_long_lists(raw: bytes) -> None:
    with pytest.raises(ApiError) as refused:
        parse_body(raw)
    assert "repeat" in refused.value.message


@pytest.mark.parametrize("raw", [
    b'{"prompt": "see: http://a:80/x", "model": "m:1", "n": 1}',
    b'{"prompt": "\\u003a", "model": "m"}',
    b'{"prompt": [' + b", ".join(b"1" for _ in range(2000)) + b'], "model": "m"}',
])
def test_colons_escapes_and_long_lists_without_a_repeat_are_fine(raw: bytes) -> None:
    assert parse_body(raw)


def _generated(rng: random.Random, depth: int = 0) -> str:
    """A JSON value whose keys and strings are drawn from a few, colons and escapes among
    them, so that repeats and colons inside strings are common."""
    keys = ["a", "b", "a:b", ":", "model", "mod\\u0065l", "x\\u003ay"]
    texts = ["", ":", "a:b::", "\\u003a", "\\\\u003a", '\\"', "é:", "\\n:"]
    roll = rng.random()
    if depth > 3 or roll < 0.3:
        if rng.random() < 0.5:
            return f'"{rng.choice(texts)}"'
        return rng.choice(["1", "null", "true", "-2.5", "[]", "{}"])
    if roll < 0.6:
        return "[" + ",".join(_generated(rng, depth + 1) for _ in range(rng.randrange(4))) + "]"
    return "{" + ",".join(f'"{rng.choice(keys)}" : {_generated(rng, depth + 1)}'
                          for _ in range(rng.randrange(4))) + "}"


def test_a_body_is_refused_exactly_when_json_loads_meets_a_repeated_key() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        raw = ("{" + ",".join(f'"{rng.choice("abm")}":{_generated(rng)}'
                              for _ in range(rng.randrange(5))) + "}").encode()
        pairs_seen: list[bool] = []

        def hook(pairs: list[tuple[str, object]], seen: list[bool] = pairs_seen) -> dict:
            seen.append(len({k for k, _ in pairs}) != len(pairs))
            return dict(pairs)

        json.loads(raw, object_pairs_hook=hook)
        try:
            parse_body(raw)
            refused = False
        except ApiError as exc:
            assert "repeat" in exc.message, raw
            refused = True
        assert refused == any(pairs_seen), raw
