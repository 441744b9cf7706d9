"""Segment-cached tokenization equals whole-text tokenization, for every kind of tokenizer the
segment planner cuts, on random and adversarial texts and through the chat templates.

Each tokenizer is trained here on generated text with ``tokenizers``; its ``tokenizer.json`` is
loaded as kvroute loads one (:func:`openai_request.tokenizer.load_tokenizer`). Small segment
targets (a few characters) make the planner cut at nearly every place it allows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from openai_request.prompts import build_prompt
from openai_request.segment_cache import SegmentCache, SegmentedTokenizer, entry_bytes
from openai_request.segments import PROVEN_REGEXES
from openai_request.tokenizer import HFTokenizer, load_tokenizer
from tests.fixtures.tokenizer_files import CHAT_TEMPLATE

SPECIALS = ["<unk>", "<s>", "</s>", "<|image|>", "<|im_start|>", "<|im_end|>", "<|user|>",
            "<|assistant|>", "<|system|>", "<|end|>"]
#: Added tokens that are not special: one not normalized, one normalized.
EXTRA = [AddedToken("<tool>", normalized=False), AddedToken("kvroute", normalized=True)]
LLAMA3_REGEX = next(r for r in PROVEN_REGEXES if r"\p{N}{1,3}" in r)
QWEN2_REGEX = next(r for r in PROVEN_REGEXES if r"|\p{N}|" in r)
GPT2_REGEX = next(r for r in PROVEN_REGEXES if r.startswith("'s"))

#: Pieces the texts are made of: words, spacing, digits, punctuation and contractions, unicode
#: (accents, a combining mark, CJK, emoji with ZWJ and skin tone, final sigma), special-token
#: look-alikes, and the tokens themselves.
PIECES = [
    "the", "router", "cache", "hello", "world", "Tokenizer", "KV", " ", " ", " ", "  ", "   ",
    "\n", "\n\n", "\t", " \n", "\r\n", "'s", "'t", "'re", "'LL", "don't", "12345", "3.14",
    "2026", ",", ".", "!?", "...", "(", ")", "{\"a\": 1}", "é", "e\u0301", "ß", "Σ", "ΟΔΟΣ",
    "日本語", "中文", "😀", "👩\u200d💻", "👍🏽", "\u00a0", "\u2581", "\u3000", "Ġ", "##", "<s",
    "s>", "</", "<|im_start", "|>", "<|", "<s >", "< s>", "<S>", "KVROUTE", "kvroute", "<tool>",
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    *SPECIALS,
]
TEXTS = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=60).map("".join),
    st.text(max_size=200),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=40).map("".join),
)


def _corpus(seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "ro", "ute", "th", "e", "ing", "pre", "fix", "ca", "che", "to", "ken",
                 "wor", "ld", "s", "t", "é", "日本", "😀", "12", "3"]
    lines = []
    for _ in range(300):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(3, 15))]
        lines.append(" ".join(words) + rng.choice([".", "!", "\n", " 2026", "'s end"]))
    return lines + [" ".join(PIECES)] * 3


def _train(tok: Tokenizer, trainer: Any, extra: list[AddedToken] = EXTRA) -> Tokenizer:
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens(extra)
    return tok


def _bpe_trainer(byte_level: bool = False) -> Any:
    extra = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()} if byte_level else {}
    return trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                               **extra)


def byte_level(add_prefix_space: bool = False, extra: list[AddedToken] = EXTRA) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    _train(tok, _bpe_trainer(byte_level=True), extra)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def split_regex(regex: str, nfc: bool) -> Tokenizer:
    """Llama 3 / Qwen 2 style: a Split regex, then byte-level without its own regex."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return _train(tok, _bpe_trainer(byte_level=True))


def metaspace(scheme: str, extra: list[AddedToken] = EXTRA[:1]) -> Tokenizer:
    """SentencePiece style: Metaspace pre-tokenizer, byte fallback off, BOS post-processor."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(prepend_scheme=scheme)
    _train(tok, _bpe_trainer(), extra)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def llama2_legacy() -> Tokenizer:
    """Llama 2's HF conversion: prepend and replace spaces in the normalizer, no
    pre-tokenizer (so only added tokens may be cut around)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0)])
    return _train(tok, _bpe_trainer())


def wordpiece() -> Tokenizer:
    """BERT style: its normalizer (lowercase, accents stripped, CJK spaced), pre-tokenizer,
    WordPiece and the ``[CLS] … [SEP]`` post-processor."""
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    _train(tok, trainers.WordPieceTrainer(vocab_size=600, special_tokens=SPECIALS,
                                          show_progress=False))
    tok.post_processor = processors.BertProcessing(("</s>", 2), ("<s>", 1))
    return tok


KINDS = {
    "byte-level": (byte_level, "segments"),
    # A prepend and only plain added tokens: cut at spaces; with a normalized added token
    # (which splits a segment, each piece prepended), only around added tokens.
    "byte-level-prefix-space": (lambda: byte_level(True, EXTRA[:1]), "segments"),
    "byte-level-prefix-space-normalized-added": (lambda: byte_level(True), "added tokens"),
    "llama3-split": (lambda: split_regex(LLAMA3_REGEX, False), "segments"),
    "qwen2-split-nfc": (lambda: split_regex(QWEN2_REGEX, True), "segments"),
    "gpt2-split": (lambda: split_regex(GPT2_REGEX, False), "segments"),
    "metaspace-first": (lambda: metaspace("first"), "segments"),
    "metaspace-always": (lambda: metaspace("always"), "segments"),
    "metaspace-always-normalized-added": (lambda: metaspace("always", EXTRA), "added tokens"),
    "llama2-legacy": (llama2_legacy, "added tokens"),
    "wordpiece": (wordpiece, "segments"),
}


def _load(tok: Tokenizer, folder: Path, template: str | None = CHAT_TEMPLATE) -> HFTokenizer:
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    loaded = load_tokenizer(str(folder))
    assert isinstance(loaded, HFTokenizer)
    return loaded


@pytest.fixture(scope="module", params=sorted(KINDS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[HFTokenizer, SegmentedTokenizer]:
    build, mode = KINDS[request.param]
    whole = _load(build(), tmp_path_factory.mktemp(request.param))
    cut = SegmentedTokenizer(whole, segment_chars=3)
    assert cut.mode == mode, cut.plan.notes
    return whole, cut


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS, target=st.integers(1, 24), special=st.booleans())
def test_segments_encode_as_the_whole(pair: tuple[HFTokenizer, SegmentedTokenizer],
                                      text: str, target: int, special: bool) -> None:
    whole, cut = pair
    cut.segment_chars = target
    expected = whole.encode(text, add_special_tokens=special)
    assert cut.encode(text, add_special_tokens=special) == expected
    # Again, now from the cache: the same ids.
    assert cut.encode(text, add_special_tokens=special) == expected


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=TEXTS, rest=TEXTS)
def test_a_prefix_seen_before_gives_the_same_ids(pair: tuple[HFTokenizer, SegmentedTokenizer],
                                                 prefix: str, rest: str) -> None:
    whole, cut = pair
    cut.segment_chars = 5
    cut.encode(prefix)
    assert cut.encode(prefix + rest) == whole.encode(prefix + rest)


def test_a_walk_stops_where_asked_and_estimates_the_rest(
        pair: tuple[HFTokenizer, SegmentedTokenizer]) -> None:
    whole, cut = pair
    cut.segment_chars = 16
    text = "</s>".join(["the router holds the prefix of every cached prompt"] * 40)
    walk = cut.walk(text)
    walk.advance(100)
    known = len(walk.ids)
    assert not walk.done and 0 < known < len(whole.encode(text))
    assert whole.encode(text)[:known] == walk.ids  # a prefix of the whole's ids
    assert walk.rest_tokens() > 0
    walk.advance(len(text))
    assert walk.done and walk.ids == whole.encode(text) and walk.rest_tokens() == 0


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                           "content": TEXTS.filter(lambda t: t and "<|image|>" not in t)}),
    min_size=1, max_size=5)


@pytest.mark.parametrize("template", [None, CHAT_TEMPLATE, CHATML],
                         ids=["built-in", "role-tags", "chatml"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(messages=MESSAGES, cue=st.booleans())
def test_chat_prompts_tokenize_as_the_whole(template: str | None, tmp_path: Path,
                                            messages: list[dict[str, str]], cue: bool) -> None:
    folder = tmp_path / "tok"
    if not folder.exists():
        folder.mkdir()
        _load(KINDS["llama3-split"][0](), folder, template)
    whole = load_tokenizer(str(folder))
    assert isinstance(whole, HFTokenizer)
    cut = SegmentedTokenizer(whole, segment_chars=4)
    body = {"messages": messages, "add_generation_prompt": cue}
    args: dict[str, Any] = {"mm_tokens_per_image": 1, "max_image_bytes": 1, "fetch": None}
    expected = build_prompt(body, "chat", whole, **args).token_ids
    assert build_prompt(body, "chat", cut, **args).token_ids == expected


def test_unsafe_files_encode_whole(tmp_path: Path) -> None:
    tok = byte_level()
    tok.add_tokens([AddedToken("<strip>", lstrip=True, normalized=False)])
    cut = SegmentedTokenizer(_load(tok, tmp_path))
    assert cut.mode == "whole" and "strips" in cut.plan.notes[0]
    text = "a <strip> b"
    assert cut.encode(text) == cut.inner.encode(text)
    assert cut.stats().misses == 0  # nothing went through the cache


def test_the_cache_is_bounded_by_bytes_least_recent_out() -> None:
    one = entry_bytes("aaaa", [1, 2])
    cache = SegmentCache(max_bytes=2 * one)
    cache.put((0, "aaaa"), [1, 2])
    cache.put((0, "bbbb"), [3, 4])
    assert cache.get((0, "aaaa")) == [1, 2]  # now the most recent
    cache.put((0, "cccc"), [5, 6])  # evicts bbbb, the least recent
    assert cache.get((0, "bbbb")) is None
    assert cache.get((1, "aaaa")) is None  # another encoder's key
    assert cache.get((0, "aaaa")) == [1, 2] and cache.get((0, "cccc")) == [5, 6]
    assert (cache.hits, cache.misses, cache.bytes, len(cache)) == (3, 2, 2 * one, 2)


@pytest.mark.parametrize(("normalizer", "note"), [
    (normalizers.Replace(" ", "\u2581"), "spaces"),  # "X▁" could be one regex match
    (normalizers.BertNormalizer(), "regex pre-tokenizer"),  # "中" becomes " 中 "
    (normalizers.Strip(), "may act across spaces"),
])
def test_normalizers_that_could_join_across_a_space_keep_only_added_token_cuts(
        tmp_path: Path, normalizer: Any, note: str) -> None:
    tok = byte_level()
    tok.normalizer = normalizer
    cut = SegmentedTokenizer(_load(tok, tmp_path), segment_chars=1)
    assert cut.mode == "added tokens" and any(note in n for n in cut.plan.notes)
    text = "a. b</s>中 x"
    assert cut.encode(text) == cut.inner.encode(text)
