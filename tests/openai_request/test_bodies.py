"""The OpenAI request protocol: body decoding, the schema, and the prompt-length bound that
lets a too-long prompt be refused before it is encoded (it must never refuse one that fits)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, normalizers, pre_tokenizers, trainers

from openai_request.bodies import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    fewest_prompt_tokens,
    parse_body,
    validate_request,
)
from openai_request.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.fixtures.tokenizer_files import SPECIALS, write_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, HFTokenizer)
    return tok


def test_a_deeply_nested_body_is_a_400_not_a_recursion_error() -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    assert caught.value.status == 400 and "nested" in caught.value.message


def test_a_valid_body_is_typed_and_its_unknown_fields_are_left_alone() -> None:
    body = {"prompt": [1, 2], "temperature": 1, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 7, "priority": 3}
    request = validate_request(body, "completions")
    assert isinstance(request, CompletionRequest)
    assert (request.prompt, request.temperature, request.output_limit) == ([1, 2], 1.0, 7)
    assert request.include_usage and body["priority"] == 3
    chat = validate_request({"messages": [{"role": "user", "content": "x"}],
                             "max_completion_tokens": 5, "max_tokens": 9}, "chat")
    assert isinstance(chat, ChatRequest) and chat.output_limit == 5


@pytest.mark.parametrize("body, kind, param", [
    ({}, "completions", "prompt"),
    ({"prompt": "x", "temperature": 2.01}, "completions", "temperature"),
    ({"prompt": "x", "top_p": "1"}, "completions", "top_p"),
    ({"prompt": "x", "logprobs": True}, "completions", "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "chat", "logprobs"),
    ({"messages": []}, "chat", "messages"),
    ({"prompt": "x"}, "chat", "messages"),
    ({"messages": [{}], "stream_options": {"include_usage": "no"}}, "chat",
     "stream_options.include_usage"),
    ({"prompt": "x", "cache_salt": ""}, "completions", "cache_salt"),
])
def test_a_schema_error_names_the_field(body: dict, kind: str, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        validate_request(body, kind)  # type: ignore[arg-type]
    assert caught.value.status == 400
    assert caught.value.param == param
    assert f"'{param}'" in caught.value.message


def test_the_byte_tokenizer_bound_is_exact_for_text_and_token_ids() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld"
    request = validate_request({"prompt": text}, "completions")
    # each character is at least one byte and each byte one token
    assert fewest_prompt_tokens(request, tok.max_bytes_per_token) == len(text)
    assert len(tok.encode(text, add_special_tokens=True)) >= len(text)
    ids = validate_request({"prompt": [[5, 6, 7]]}, "completions")
    assert fewest_prompt_tokens(ids, None) == 3
    chat = validate_request({"messages": [{"role": "user", "content": "x" * 99}]}, "chat")
    assert fewest_prompt_tokens(chat, 1) == 0, "a chat template may drop content"


def test_a_byte_level_bpe_gets_the_longest_token_as_its_bound(tiny: HFTokenizer) -> None:
    bound = tiny.max_bytes_per_token
    assert bound is not None
    assert bound >= len("<|image|>"), "an added token matches its whole text"


@settings(max_examples=100, deadline=None)
@given(text=st.lists(st.sampled_from([*"ab the fox", "é", "漢", "\U0001f600", "\n",
                                      *SPECIALS]), max_size=300).map("".join)
       | st.text(max_size=200))
def test_the_bound_never_exceeds_the_real_token_count(tiny: HFTokenizer, text: str) -> None:
    request = validate_request({"prompt": text}, "completions")
    fewest = fewest_prompt_tokens(request, tiny.max_bytes_per_token)
    assert len(tiny.encode(text, add_special_tokens=True)) >= fewest


def _trained(normalizer: object | None, pre: object) -> HFTokenizer:
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    if normalizer is not None:
        raw.normalizer = normalizer
    raw.pre_tokenizer = pre
    raw.train_from_iterator(["the quick brown fox"] * 4, trainer=trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<unk>"], show_progress=False))
    return HFTokenizer(raw.to_str().encode(), source="memory")


@pytest.mark.parametrize("normalizer, pre", [
    (None, pre_tokenizers.Whitespace()),  # drops every space: "   " is no token at all
    (normalizers.Lowercase(), pre_tokenizers.ByteLevel()),  # may shorten the text
    (normalizers.NFC(), pre_tokenizers.Metaspace()),  # composes "e" + U+0301 into "é"
    (normalizers.Replace("ab", "x"), pre_tokenizers.Metaspace()),
])
def test_no_bound_where_the_text_can_shrink_before_the_model(
        normalizer: object | None, pre: object) -> None:
    tok = _trained(normalizer, pre)
    assert tok.max_bytes_per_token is None


@settings(max_examples=100, deadline=None)
@given(text=st.lists(st.sampled_from([*"ab the fox", " ", "  ", "é", "\U0001f600"]),
                     max_size=200).map("".join))
def test_a_llama_style_sentencepiece_bpe_is_bounded_and_the_bound_holds(text: str) -> None:
    # Llama 2's tokenizer.json: spaces become "▁" by normalizers, bytes fall back to <0xNN>.
    raw = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    raw.train_from_iterator(["the quick brown fox"] * 4, trainer=trainers.BpeTrainer(
        vocab_size=80, special_tokens=["<unk>", *(f"<0x{b:02X}>" for b in range(256))],
        show_progress=False))
    tok = HFTokenizer(raw.to_str().encode(), source="memory")
    assert tok.max_bytes_per_token is not None
    request = validate_request({"prompt": text}, "completions")
    assert len(tok.encode(text)) >= fewest_prompt_tokens(request, tok.max_bytes_per_token)


def test_no_bound_when_unknown_runs_fuse(tmp_path: Path) -> None:
    raw = RawTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.train_from_iterator(["the fox"] * 4, trainer=trainers.BpeTrainer(
        vocab_size=40, special_tokens=["<unk>"], show_progress=False))
    tok = HFTokenizer(raw.to_str().encode(), source="memory")
    assert tok.max_bytes_per_token is None
    assert len(tok.encode("Z" * 100)) == 2, "a space and 100 unknown characters: two tokens"
