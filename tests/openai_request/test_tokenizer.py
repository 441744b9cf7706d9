"""The byte-level tokenizer's exact ids, and loading a Hugging Face tokenizer from local files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openai_request.tokenizer import (
    BOS_ID,
    BYTE_OFFSET,
    EOS_ID,
    IMAGE_ID,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from tests.fixtures.tokenizer_files import CHAT_TEMPLATE, write_tiny_tokenizer


def test_byte_tokenizer_ids_are_bytes_plus_offset() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer)
    assert isinstance(tok, Tokenizer)
    assert tok.identity == "bytes-v1"
    assert tok.vocab_size == 260
    assert (BYTE_OFFSET, BOS_ID, EOS_ID, IMAGE_ID) == (4, 1, 2, 3)
    assert (tok.bos_token_id, tok.eos_token_id, tok.image_token_id) == (1, 2, 3)
    assert tok.encode("Hi") == [76, 109]
    assert tok.encode("Hi", add_special_tokens=True) == [1, 76, 109]
    # "é" is two UTF-8 bytes, 0xC3 0xA9.
    assert tok.encode("é") == [0xC3 + 4, 0xA9 + 4]
    assert tok.encode("") == []
    assert tok.chat_template is None


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld ✓", "\x00\n\t", "🙂" * 3])
def test_byte_tokenizer_round_trips(text: str) -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text, add_special_tokens=True)) == text


def test_byte_tokenizer_decode_drops_specials_and_replaces_broken_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.decode([BOS_ID, 76, IMAGE_ID, 109, EOS_ID]) == "Hi"
    assert tok.decode([0xC3 + 4]) == "\ufffd"


def test_byte_tokenizer_decode_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match=r"^token id 260 is out of range \[0, 260\)$"):
        ByteTokenizer().decode([76, 260])
    with pytest.raises(ValueError, match=r"^token id -1 is out of range"):
        ByteTokenizer().decode([-1])


def test_hf_tokenizer_loads_identically_from_dir_and_file(tmp_path: Path) -> None:
    file = write_tiny_tokenizer(tmp_path)
    by_dir = load_tokenizer(str(tmp_path))
    by_file = load_tokenizer(str(file))
    assert isinstance(by_dir, HFTokenizer)
    text = "hello router, the cache holds héllo ✓ <|image|>"
    assert by_dir.encode(text) == by_file.encode(text)
    assert by_dir.identity == by_file.identity
    assert by_dir.identity.startswith("hf:") and len(by_dir.identity) == 3 + 16
    # Specials from tokenizer_config.json (eos given as an AddedToken object).
    assert (by_dir.bos_token_id, by_dir.eos_token_id, by_dir.image_token_id) == (1, 2, 3)
    assert (by_dir.bos_token, by_dir.eos_token) == ("<s>", "</s>")
    assert by_dir.chat_template == CHAT_TEMPLATE
    assert by_dir.vocab_size == 378


def test_hf_tokenizer_specials_and_round_trip(tmp_path: Path) -> None:
    tok = load_tokenizer(str(write_tiny_tokenizer(tmp_path)))
    ids = tok.encode("hello router")
    assert tok.encode("hello router", add_special_tokens=True) == [1, *ids]
    assert tok.decode([1, *ids, 2]) == "hello router"
    # The special-token text in a rendered chat becomes its id without special-token handling.
    assert tok.encode("<s>hello</s>")[0] == 1
    assert tok.encode("<s>hello</s>")[-1] == 2
    with pytest.raises(ValueError, match=r"^token id 378 is out of range \[0, 378\)$"):
        tok.decode([378])


def test_hf_identity_covers_template_and_specials(tmp_path: Path) -> None:
    dirs = [tmp_path / n for n in ("a", "b", "c", "d")]
    for d in dirs:
        d.mkdir()
    write_tiny_tokenizer(dirs[0])
    write_tiny_tokenizer(dirs[1])
    write_tiny_tokenizer(dirs[2], chat_template=None)
    write_tiny_tokenizer(dirs[3], config={"eos_token": "<unk>"})
    ids = [load_tokenizer(str(d)).identity for d in dirs]
    assert ids[0] == ids[1]  # training is deterministic: same bytes, same identity
    assert len(set(ids[1:])) == 3


def test_hf_chat_template_file_wins_over_config(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert load_tokenizer(str(tmp_path)).chat_template == "{{ messages[0]['content'] }}"


def test_hf_named_template_list_picks_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    write_tiny_tokenizer(tmp_path, config={"chat_template": named})
    assert load_tokenizer(str(tmp_path)).chat_template == "D"


def test_hf_without_config_has_no_specials(tmp_path: Path) -> None:
    file = write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    tok = load_tokenizer(str(file))
    assert (tok.bos_token_id, tok.eos_token_id, tok.chat_template) == (None, None, None)
    assert tok.image_token_id == 3  # found by its conventional name <|image|>


def test_load_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=rf"^tokenizer path {missing} does not exist: give "):
        load_tokenizer(str(missing))
    no_file = rf"^tokenizer directory {tmp_path} has no tokenizer\.json$"
    with pytest.raises(ValueError, match=no_file):
        load_tokenizer(str(tmp_path))
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^cannot parse tokenizer file {broken}: "):
        load_tokenizer(str(tmp_path))


def test_load_errors_for_bad_config(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^tokenizer config {config} is not a JSON object$"):
        load_tokenizer(str(tmp_path))
    config.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^cannot read tokenizer config {config}: "):
        load_tokenizer(str(tmp_path))
    config.write_text(json.dumps({"eos_token": "<eos>"}), encoding="utf-8")
    with pytest.raises(
        ValueError,
        match=rf"^eos_token '<eos>' is not in the vocabulary of {tmp_path / 'tokenizer.json'}$",
    ):
        load_tokenizer(str(tmp_path))
    config.write_text(json.dumps({"chat_template": 7}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"chat_template in .* is not a string$"):
        load_tokenizer(str(tmp_path))


def test_byte_ids_are_utf8_bytes_plus_offset_across_unicode() -> None:
    import random

    rng = random.Random(5)
    tok = ByteTokenizer()
    for _ in range(200):
        text = "".join(chr(rng.choice([rng.randrange(0, 0x80), rng.randrange(0x80, 0x800),
                                       rng.randrange(0x800, 0xD800),
                                       rng.randrange(0x10000, 0x110000)]))
                       for _ in range(rng.randrange(1, 40)))
        assert tok.encode(text) == [b + 4 for b in text.encode("utf-8")]


def test_compiled_byte_ids_match_the_python_encode() -> None:
    import random

    from openai_request import tokenizer

    if tokenizer._compiled_ids is None:
        pytest.skip("native._byte_tokens is not built")
    rng = random.Random(11)
    tok = ByteTokenizer()
    texts = ["", "a", "\x00", "\U0010ffff", "é" * 300, "x" * 5000]
    for _ in range(500):
        texts.append("".join(chr(rng.choice([rng.randrange(0, 0x80), rng.randrange(0x80, 0x800),
                                             rng.randrange(0x800, 0xD800),
                                             rng.randrange(0xE000, 0x110000)]))
                             for _ in range(rng.randrange(0, 300))))
    for text in texts:
        for special in (False, True):
            assert tok.encode(text, add_special_tokens=special) == tokenizer._python_ids(
                text, special)


def test_compiled_byte_ids_read_a_table_of_256() -> None:
    byte_ids = pytest.importorskip("native._byte_tokens").byte_ids
    table = [b * 3 for b in range(256)]
    data = bytes(range(256)) * 2
    assert byte_ids(data, table) == [b * 3 for b in data]
    assert byte_ids(data, table, "first") == ["first", *(b * 3 for b in data)]
    assert byte_ids(b"", table) == []
    with pytest.raises(ValueError, match="256"):
        byte_ids(b"a", table[:255])
