"""Responses API and Anthropic Messages API bodies as the chat bodies they are routed by,
converted as vLLM converts them."""

from __future__ import annotations

from typing import Any

import pytest

from openai_request.translated import chat_of_messages, chat_of_responses


def test_a_string_input_is_a_user_message_after_the_instructions() -> None:
    assert chat_of_responses({"model": "m", "instructions": "Be brief.", "input": "hi",
                              "max_output_tokens": 4, "cache_salt": "s"}) == {
        "model": "m", "cache_salt": "s", "add_special_tokens": True,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "hi"}]}


def test_response_items_become_chat_messages_in_order() -> None:
    body = {"model": "m", "input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "what is 2+2?"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "let me check"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\":2}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {"role": "user", "content": [{"type": "input_text", "text": "and "},
                                     {"type": "input_image", "image_url": "data:x"}]},
    ]}
    assert chat_of_responses(body)["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": "let me check",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "add", "arguments": "{\"a\":2}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "and "},
                                     {"type": "image_url", "image_url": {"url": "data:x"}}]},
    ]


def test_a_system_of_blocks_is_one_system_message_without_the_billing_header() -> None:
    body = {"model": "claude", "max_tokens": 8,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                       {"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
            "messages": [{"role": "user", "content": "hello"}]}
    assert chat_of_messages(body) == {"model": "claude", "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]}


def test_anthropic_blocks_become_text_images_tool_calls_and_tool_messages() -> None:
    body: dict[str, Any] = {"model": "m", "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAA"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm"},
            {"type": "tool_use", "id": "t1", "name": "zoom", "input": {"x": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "zoomed"}]}]},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
    ]}
    assert chat_of_messages(body)["messages"] == [
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "zoom", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "zoomed"},
        {"role": "assistant", "content": "done"},
    ]


@pytest.mark.parametrize(("convert", "body", "says"), [
    (chat_of_responses, {"input": 3}, "input must be a string or a list"),
    (chat_of_responses, {"input": ["hi"]}, r"input\[0\] must be an object"),
    (chat_of_responses, {"input": "x", "instructions": ["a"]}, "instructions must be a string"),
    (chat_of_responses, {"input": [{"role": "user", "content": 5}]}, "content must be"),
    (chat_of_messages, {"messages": "hi"}, "messages must be a list"),
    (chat_of_messages, {"messages": [{"role": "user", "content": 1}]}, "content must be"),
    (chat_of_messages, {"system": 4, "messages": []}, "system must be"),
])
def test_a_body_of_the_wrong_shape_is_refused_naming_the_field(convert: Any, body: Any,
                                                               says: str) -> None:
    with pytest.raises(ValueError, match=says):
        convert(body)
