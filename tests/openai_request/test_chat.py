"""Chat rendering: the built-in format, Jinja templates, and each invalid message's error."""

from __future__ import annotations

from typing import Any

import pytest

from openai_request.chat import ImageRef, normalize_messages, render_chat, render_chat_with_images
from tests.fixtures.tokenizer_files import CHAT_TEMPLATE

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


def test_default_format_exact() -> None:
    assert render_chat(CONVERSATION, None) == (
        "<|system|>\nBe brief.<|end|>\n"
        "<|user|>\nHi<|end|>\n"
        "<|assistant|>\nHello.<|end|>\n"
        "<|user|>\nBye<|end|>\n"
        "<|assistant|>\n"
    )
    assert render_chat(CONVERSATION[:2], None, add_generation_prompt=False) == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n"
    )


def test_jinja_template_exact() -> None:
    text = render_chat(CONVERSATION, CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>")
    assert text == (
        "<s>[SYSTEM] Be brief.</s>[USER] Hi</s>[ASSISTANT] Hello.</s>[USER] Bye</s>[ASSISTANT] "
    )
    no_cue = render_chat(CONVERSATION[1:2], CHAT_TEMPLATE, add_generation_prompt=False)
    assert no_cue == "[USER] Hi"


def test_parts_join_with_newlines_and_images_become_markers() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                {"type": "image_url", "image_url": {"url": "https://x/b.png", "uuid": "b"}},
                {"type": "text", "text": "please."},
            ],
        }
    ]
    text, images = render_chat_with_images(messages, None)
    assert text == "<|user|>\nCompare\n<|image|>\n<|image|>\nplease.<|end|>\n<|assistant|>\n"
    assert images == [
        ImageRef(url="data:image/png;base64,AA==", uuid=None),
        ImageRef(url="https://x/b.png", uuid="b"),
    ]


def test_image_uuid_at_part_level_and_bare_url_string() -> None:
    part = {"type": "image_url", "image_url": "https://x/a.png", "uuid": "u1"}
    flat, images = normalize_messages([{"role": "user", "content": [part]}])
    assert flat == [{"role": "user", "content": "<|image|>"}]
    assert images == [ImageRef(url="https://x/a.png", uuid="u1")]
    # Agreeing UUIDs in both places are fine.
    part = {
        "type": "image_url",
        "image_url": {"url": "https://x/a.png", "uuid": "u1"},
        "uuid": "u1",
    }
    assert normalize_messages([{"role": "user", "content": [part]}])[1][0].uuid == "u1"


def test_assistant_without_content_and_extra_keys_kept() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    flat, _ = normalize_messages([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert flat == [{"role": "assistant", "content": "", "tool_calls": calls}]


def test_template_sees_extra_keys() -> None:
    template = "{% for m in messages %}{{ m['name'] }}:{{ m['content'] }};{% endfor %}"
    messages = [{"role": "user", "content": "x", "name": "ann"}]
    assert render_chat(messages, template) == "ann:x;"


def test_template_raise_exception_becomes_value_error() -> None:
    with pytest.raises(ValueError, match=r"^a conversation cannot start with a tool result$"):
        render_chat([{"role": "tool", "content": "42"}], CHAT_TEMPLATE)


def test_template_is_sandboxed() -> None:
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match=r"^chat template failed to render: "):
        render_chat(CONVERSATION, escape)


def test_template_syntax_error() -> None:
    with pytest.raises(ValueError, match=r"^chat template is not valid Jinja: "):
        render_chat(CONVERSATION, "{% for m in messages %}")


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        (None, "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        ({"role": "user"}, "messages must be a non-empty list"),
        (["hi"], "messages[0] must be an object"),
        ([{"content": "x"}], "messages[0].role must be one of system, user, assistant, tool"),
        (
            [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}],
            "messages[1].role must be one of system, user, assistant, tool",
        ),
        ([{"role": "user"}], "messages[0].content is required"),
        (
            [{"role": "user", "content": 5}],
            "messages[0].content must be a string or a list of content parts",
        ),
        ([{"role": "user", "content": ["x"]}], "messages[0].content[0] must be an object"),
        (
            [{"role": "user", "content": [{"type": "audio"}]}],
            "messages[0].content[0].type must be 'text' or 'image_url'",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            "messages[0].content[0].text must be a string",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            "messages[0].content[0].image_url must be an object with a url",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}],
            "messages[0].content[0].image_url.url must be a non-empty string",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "u"}, "uuid": 3}],
                }
            ],
            "messages[0].content[0].uuid must be a non-empty string",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "u", "uuid": ""}}],
                }
            ],
            "messages[0].content[0].image_url.uuid must be a non-empty string",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "u", "uuid": "a"}, "uuid": "b"}
                    ],
                }
            ],
            "messages[0].content[0].uuid and messages[0].content[0].image_url.uuid differ",
        ),
        (
            [{"role": "user", "content": "see <|image|>"}],
            "messages[0].content must not contain the reserved text '<|image|>'",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "<|image|>"}]}],
            "messages[0].content[0].text must not contain the reserved text '<|image|>'",
        ),
    ],
)
def test_invalid_messages(messages: Any, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        render_chat(messages, None)
    assert str(info.value) == reason
