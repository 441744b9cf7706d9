"""The early tries of a body read in pieces: offered once ``model`` is known and the prompt is
being read, at doubling sizes, with the tail still to come stood in for byte for byte."""

from __future__ import annotations

import json

import pytest

from openai_request.early_body import FIRST_TRY_BYTES, LAST_TRY_BYTES, EarlyBody

TEXT = "a prompt read in pieces " * 2_000


@pytest.mark.parametrize("cut", [FIRST_TRY_BYTES + 1, FIRST_TRY_BYTES + 2])  # odd, even tails
def test_the_padded_prompt_is_as_long_as_the_whole_body_says(cut: int) -> None:
    raw = json.dumps({"model": "m", "prompt": TEXT, "max_tokens": 1}).encode()
    early = EarlyBody("completions", len(raw))
    tries = early.feed(raw[:cut])
    assert tries is not None
    partial, padded = tries
    assert TEXT.startswith(partial["prompt"])
    assert padded["prompt"].startswith(partial["prompt"])
    assert len(padded["prompt"].encode()) == len(partial["prompt"].encode()) + len(raw) - cut
    # the stand-in has a space every other character, for the tokenizer's cutter
    assert padded["prompt"][len(partial["prompt"]):].count(" ") >= (len(raw) - cut) // 2


def test_a_chat_body_pads_its_last_message_and_tries_again_at_twice_the_bytes() -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": TEXT}]}).encode()
    early = EarlyBody("chat", len(raw))
    assert early.feed(raw[:1000]) is None  # fewer bytes than the first try wants
    first = early.feed(raw[1000:FIRST_TRY_BYTES])
    assert first is not None
    _, padded = first
    assert padded["messages"][0] == {"role": "system", "content": "be brief"}
    assert early.feed(raw[FIRST_TRY_BYTES:FIRST_TRY_BYTES + 100]) is None
    assert early.feed(raw[FIRST_TRY_BYTES + 100:2 * FIRST_TRY_BYTES]) is not None


def test_a_body_naming_its_model_after_the_prompt_is_never_tried() -> None:
    raw = json.dumps({"prompt": TEXT, "model": "m"}).encode()
    early = EarlyBody("completions", len(raw))
    assert all(early.feed(raw[at:at + 4096]) is None for at in range(0, len(raw), 4096))


def test_a_body_naming_its_model_after_the_prompt_is_tried_with_the_only_model() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": TEXT}], "model": "m"}).encode()
    early = EarlyBody("chat", len(raw), only_model="m")
    tries = [t for at in range(0, len(raw), 4096) if (t := early.feed(raw[at:at + 4096]))]
    assert tries, "an SDK-ordered body is tried before its end"
    partial, padded = tries[0]
    assert partial["model"] == padded["model"] == "m"
    assert TEXT.startswith(partial["messages"][0]["content"])
    # a body that named its model before the prompt keeps its own
    named = json.dumps({"model": "other", "prompt": TEXT}).encode()
    tried = EarlyBody("completions", len(named), only_model="m").feed(named[:FIRST_TRY_BYTES])
    assert tried is not None and tried[0]["model"] == "other"


def test_no_try_once_more_than_the_last_try_bytes_arrived() -> None:
    raw = json.dumps({"model": "m", "prompt": TEXT * 4}).encode()
    early = EarlyBody("completions", len(raw))
    tried = [at + 4096 for at in range(0, len(raw), 4096)
             if early.feed(raw[at:at + 4096]) is not None]
    assert tried == [FIRST_TRY_BYTES * 2 ** k for k in range(4)]
    assert tried[-1] * 2 > LAST_TRY_BYTES
    # a body whose first piece is already past it is never tried
    assert EarlyBody("completions", len(raw)).feed(raw[:LAST_TRY_BYTES + 1]) is None
