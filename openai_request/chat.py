r"""Chat templates: OpenAI-style messages to the prompt text a model was trained on.

A tokenizer that ships a Jinja chat template (``tokenizer_config.json``) is rendered with it, in
a sandboxed Jinja environment with the settings ``transformers`` uses. Otherwise the built-in
format is::

    <|{role}|>\n{content}<|end|>\n      for each message, in order
    <|assistant|>\n                      once more, when add_generation_prompt

Either way, messages are validated and flattened first (:func:`normalize_messages`): each
message's content becomes one string, its parts joined with ``"\n"`` and every image part
written as the marker :data:`openai_request.images.IMAGE_MARKER`.
A template therefore only ever sees
string contents (templates that iterate over content parts, as some multimodal Hugging Face
templates do, are not supported), and :mod:`openai_request.prompts` later splits the text at the
markers and puts each image's placeholder positions there.

A ``ValueError`` about the messages is worded for an HTTP 400 reply and names the field
(``messages[1].content[0].text``); a template that does not compile or render is reported as a
``ValueError`` too, saying so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from openai_request.images import IMAGE_MARKER

__all__ = [
    "ROLES",
    "ImageRef",
    "normalize_messages",
    "render_chat",
    "render_chat_with_images",
]

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image part of a message, in prompt order: its URL and the caller's UUID, if any."""

    url: str
    uuid: str | None


def normalize_messages(messages: Any) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Validate OpenAI-style chat messages and flatten each content to one string.

    Args:
        messages: a non-empty list of ``{"role": ..., "content": ...}`` objects. Content is a
            string, a list of parts (``{"type": "text", "text": ...}`` or
            ``{"type": "image_url", "image_url": {"url": ..., "uuid"?: ...}}``, the UUID also
            accepted at the part's top level), or absent/``None`` for an assistant message.

    Returns:
        Copies of the messages with string contents (other keys kept, for templates that read
        them), and the image parts in the order their markers appear.

    Raises:
        ValueError: a message, part or field is missing, of the wrong type or value, or text
            contains the reserved image marker.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    flat: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if content is None:
            if role != "assistant":
                raise ValueError(f"{where}.content is required")
            text = ""
        elif isinstance(content, str):
            _check_text(content, f"{where}.content")
            text = content
        elif isinstance(content, list):
            text = "\n".join(
                _flatten_part(p, f"{where}.content[{j}]", images) for j, p in enumerate(content)
            )
        else:
            raise ValueError(f"{where}.content must be a string or a list of content parts")
        flat.append({**message, "content": text})
    return flat, images


def _flatten_part(part: Any, where: str, images: list[ImageRef]) -> str:
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be an object")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.text must be a string")
        _check_text(text, f"{where}.text")
        return text
    if kind == "image_url":
        images.append(_image_ref(part, where))
        return IMAGE_MARKER
    raise ValueError(f"{where}.type must be 'text' or 'image_url'")


def _image_ref(part: dict[str, Any], where: str) -> ImageRef:
    image_url = part.get("image_url")
    # OpenAI sends {"url": ...}; a bare string is accepted as well, as vLLM does.
    url: Any
    if isinstance(image_url, str):
        url, inner_uuid = image_url, None
    elif isinstance(image_url, dict):
        url, inner_uuid = image_url.get("url"), image_url.get("uuid")
    else:
        raise ValueError(f"{where}.image_url must be an object with a url")
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}.image_url.url must be a non-empty string")
    outer_uuid = part.get("uuid")
    for value, field in ((outer_uuid, f"{where}.uuid"), (inner_uuid, f"{where}.image_url.uuid")):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{field} must be a non-empty string")
    if outer_uuid is not None and inner_uuid is not None and outer_uuid != inner_uuid:
        raise ValueError(f"{where}.uuid and {where}.image_url.uuid differ")
    return ImageRef(url=url, uuid=outer_uuid if outer_uuid is not None else inner_uuid)


def _check_text(text: str, where: str) -> None:
    if IMAGE_MARKER in text:
        raise ValueError(f"{where} must not contain the reserved text {IMAGE_MARKER!r}")


def render_chat(
    messages: Any,
    template: str | None,
    add_generation_prompt: bool = True,
    *,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """Render chat messages to prompt text.

    Args:
        messages: OpenAI-style messages (see :func:`normalize_messages`).
        template: a Jinja chat template (Hugging Face conventions: it sees ``messages``,
            ``add_generation_prompt``, ``bos_token``, ``eos_token`` and may call
            ``raise_exception``), or ``None`` for the built-in format (module docstring).
        add_generation_prompt: end with the cue for the assistant's reply.
        bos_token: BOS text, for templates that write it.
        eos_token: EOS text, for templates that write it.

    Returns:
        The prompt text; each image part appears as :data:`openai_request.images.IMAGE_MARKER`.

    Raises:
        ValueError: the messages are invalid, the template rejects them (its
            ``raise_exception`` message is passed on), or the template fails to render.
    """
    text, _ = render_chat_with_images(
        messages, template, add_generation_prompt, bos_token=bos_token, eos_token=eos_token
    )
    return text


def render_chat_with_images(
    messages: Any,
    template: str | None,
    add_generation_prompt: bool = True,
    *,
    bos_token: str = "",
    eos_token: str = "",
) -> tuple[str, list[ImageRef]]:
    """Render chat messages, and return their image parts too (in marker order).

    Arguments, return text and errors as for :func:`render_chat`.
    """
    flat, images = normalize_messages(messages)
    if template is None:
        out = [f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in flat]
        if add_generation_prompt:
            out.append("<|assistant|>\n")
        return "".join(out), images
    compiled = _compile(template)
    try:
        text = compiled.render(
            messages=flat,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except _TemplateRejected as e:
        raise ValueError(str(e)) from None
    except jinja2.TemplateError as e:  # includes the sandbox's SecurityError
        raise ValueError(f"chat template failed to render: {e}") from e
    return text, images


class _TemplateRejected(Exception):
    """Raised by a template's ``raise_exception`` call: the template refuses the messages."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRejected(message)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # The settings transformers uses, so templates written for it render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template is not valid Jinja: {e}") from e
