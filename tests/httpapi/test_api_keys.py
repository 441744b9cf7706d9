"""Client API keys: the keys file's lines, hashed at rest, and which entry a key matches."""

from __future__ import annotations

import hashlib

import pytest

from httpapi.api_keys import OTHER, KeyRing, generate_key, hash_line, parse_keys, presented_key


def test_a_hashed_line_parses_back_to_an_entry_that_matches_only_its_key() -> None:
    line = hash_line("sk-alice", "alice", 1200, salt=bytes(range(16)))
    digest = hashlib.sha256(bytes(range(16)) + b"sk-alice").hexdigest()
    key_id = hashlib.sha256(b"sk-alice").hexdigest()[:12]
    assert line == f"sha256${bytes(range(16)).hex()}${digest} id={key_id} name=alice tpm=1200"
    assert "sk-alice" not in line
    [entry] = parse_keys(line)
    assert (entry.name, entry.tokens_per_minute, entry.label) == ("alice", 1200, "alice")
    assert entry.matches(b"sk-alice") and not entry.matches(b"sk-alicf")


def test_the_same_key_hashes_differently_under_each_salt() -> None:
    assert hash_line("k").split()[0] != hash_line("k").split()[0]


def test_a_key_ring_names_the_entry_a_key_matches_and_remembers_it() -> None:
    text = "\n".join(["# the team's keys", hash_line("k1", "one"), hash_line("k2"),
                      "", hash_line("k3", "three", 0) + "  # no limit"])
    ring = KeyRing(parse_keys(text))
    assert [k.label for k in ring.keys] == ["one", OTHER, "three"]
    assert ring.identify("k2") is ring.keys[1]
    assert ring.identify("k2") is ring.keys[1]  # now from memory
    assert ring.identify("k3") is ring.keys[2] and ring.keys[2].tokens_per_minute == 0
    assert ring.identify("k4") is None and ring.identify("") is None


def test_a_key_is_looked_for_under_its_id_and_lines_without_one_by_every_salt() -> None:
    with_id = hash_line("k1", "one")
    salt_and_digest = with_id.split()[0]
    wrong_id = f"{salt_and_digest} id=000000000000 name=two"  # k1's hash under another id
    no_id = hash_line("k3").split(" id=")[0] + " name=three"  # a line written by hand
    ring = KeyRing(parse_keys("\n".join([with_id, no_id])))
    assert [k.key_id is None for k in ring.keys] == [False, True]
    assert ring.identify("k1") is ring.keys[0]
    assert ring.identify("k3") is ring.keys[1]  # no id: found by trying its salt
    # An entry is found only under its id: under another one, its own key misses it.
    assert KeyRing(parse_keys(wrong_id)).identify("k1") is None


def test_lines_from_the_environment_are_separated_by_semicolons() -> None:
    ring = KeyRing(parse_keys(f"{hash_line('a', 'a')};{hash_line('b', 'b')}"))
    assert [k.name for k in ring.keys] == ["a", "b"]


@pytest.mark.parametrize(("text", "says"), [
    ("sk-plain-key", "line 1: not sha256$SALT$DIGEST"),
    (f"{hash_line('a')} owner=me", "'owner=me' is not id=ID, name=NAME"),
    (f"{hash_line('a')} tpm=-3", "'tpm=-3' is not id=ID, name=NAME or tpm"),
    (f"{hash_line('a')} id=xyz", "'id=xyz' is not id=ID"),
    (f"{hash_line('a', 'x')}\n{hash_line('b', 'x')}", "line 2: the name 'x' is taken"),
    ("# nothing\n\n", "holds no key"),
])
def test_a_malformed_file_is_refused_naming_the_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"keys\.txt") as caught:
        parse_keys(text, "keys.txt")
    assert says in str(caught.value)


@pytest.mark.parametrize(("name", "tpm"), [("bad name", None), ("", None), ("a", -1)])
def test_hash_line_refuses_a_bad_name_or_rate(name: str, tpm: int | None) -> None:
    with pytest.raises(ValueError):
        hash_line("k", name, tpm)
    with pytest.raises(ValueError, match="empty"):
        hash_line("")


def test_a_generated_key_carries_256_bits() -> None:
    key = generate_key()
    assert key.startswith("kvr-") and len(key) == 4 + 43 and key != generate_key()


@pytest.mark.parametrize(("headers", "key"), [
    ({"authorization": "Bearer sk-1"}, "sk-1"),
    ({"authorization": "bearer  sk-1 "}, "sk-1"),
    ({"x-api-key": "sk-2"}, "sk-2"),
    ({"authorization": "Basic abc", "x-api-key": "sk-2"}, "sk-2"),
    ({"authorization": "Bearer "}, None),
    ({"x-api-key": "  "}, None),
    ({}, None),
])
def test_the_presented_key_is_the_bearer_token_or_x_api_key(headers: dict[str, str],
                                                            key: str | None) -> None:
    assert presented_key(headers) == key
