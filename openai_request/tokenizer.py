"""Tokenizers the router and the workers share: byte-level by default, a Hugging Face file as the
real option.

The router must produce exactly the worker's token ids for a request, or its prefix lookups
miss. Both sides therefore load the same :class:`Tokenizer` through :func:`load_tokenizer`, and
each names it with :attr:`Tokenizer.identity`; the router refuses a worker whose identity
differs from its own.

Notes:
    1. The byte-level tokenizer needs no files: token id = byte value + :data:`BYTE_OFFSET`;
       ids below the offset are specials (:data:`PAD_ID`, :data:`BOS_ID`, :data:`EOS_ID`,
       :data:`IMAGE_ID`). Its identity is ``"bytes-v1"``; any change to the mapping must bump it.
    2. A Hugging Face tokenizer is a ``tokenizer.json`` (read with the ``tokenizers`` library,
       never the model hub), with an optional ``tokenizer_config.json`` beside it that may give
       ``chat_template``, ``bos_token``, ``eos_token`` and ``image_token``; a
       ``chat_template.jinja`` file beside it wins over the config's template, as in recent
       ``transformers``. Its identity is ``"hf:"`` + the first 16 hex digits of a SHA-256 over
       the ``tokenizer.json`` bytes and the settings read from the config (chat template,
       BOS/EOS strings, image token id), because each of them changes the ids a request becomes.
    3. ``encode`` adds no special tokens unless asked: a chat template writes its own BOS, and
       a completions prompt asks for them (as vLLM does).
    4. ``decode`` drops special tokens: it turns generated ids into response text.
    5. :attr:`Tokenizer.max_bytes_per_token` bounds the UTF-8 bytes of text one token can
       stand for, where the tokenizer makes that provable, so that a prompt of ``n``
       characters is known to need at least ``n / max_bytes_per_token`` tokens without
       encoding it (every character is at least one byte). A Hugging Face tokenizer has one
       when its model is BPE, nothing shortens the text or drops characters before the model
       (normalizers that only prepend or replace a string by one at least as long, and only
       the pre-tokenizers in :data:`_KEEPS_TEXT`), no run of unknown characters
       becomes one token, and no added token absorbs the spaces around it. The bound is then
       the longest token's UTF-8 length: a byte-level or metaspace token's text is at least as
       long as the text it stands for.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import tokenizers

from openai_request.tokenizer_source import resolve_tokenizer

__all__ = [
    "BOS_ID",
    "BYTE_OFFSET",
    "EOS_ID",
    "IMAGE_ID",
    "PAD_ID",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
IMAGE_ID = 3
#: Ids below this are specials; byte ``b`` is token ``b + BYTE_OFFSET``.
BYTE_OFFSET = 4

# Tokens a multimodal tokenizer commonly reserves for image positions, tried in this order when
# the config names none.
_IMAGE_TOKEN_CANDIDATES = ("<|image|>", "<image>", "<|image_pad|>", "<|IMAGE|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the router and the workers need from a tokenizer."""

    @property
    def identity(self) -> str:
        """A stable name for this exact tokenization; equal identities encode equally."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of token ids, specials included; valid ids are ``[0, vocab_size)``."""
        ...

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id, or ``None`` when the tokenizer has none."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """End-of-sequence id, or ``None`` when the tokenizer has none."""
        ...

    @property
    def image_token_id(self) -> int:
        """The placeholder id written at every position an image occupies."""
        ...

    @property
    def bos_token(self) -> str:
        """BOS as text, for chat templates that write it (``""`` when none)."""
        ...

    @property
    def eos_token(self) -> str:
        """EOS as text, for chat templates that write it (``""`` when none)."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template shipped with the tokenizer, or ``None`` for the default."""
        ...

    @property
    def max_bytes_per_token(self) -> int | None:
        """The most bytes of text one token stands for, or ``None`` when unbounded (note 5)."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Return the ids of ``text``; with ``add_special_tokens``, also BOS (and so on)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids``, special tokens dropped."""
        ...


_SHIFTED = bytes(range(BYTE_OFFSET, 256)) + bytes(BYTE_OFFSET)  # b -> b + 4 for b <= 251
#: Each byte's id, for the compiled encode (``native._byte_tokens``).
_BYTE_IDS = [b + BYTE_OFFSET for b in range(256)]



def _compiled() -> Callable[[bytes, list[int], int | None], list[int]] | None:
    """The compiled encode (``native/_byte_tokens.pyx``), unless ``KVROUTE_PURE_PYTHON`` is
    set or it is not built: then None, and :func:`_python_ids`, its specification, encodes."""
    if os.environ.get("KVROUTE_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from native._byte_tokens import byte_ids  # type: ignore[import-not-found]
    except ImportError:
        return None
    return byte_ids  # type: ignore[no-any-return]


_compiled_ids = _compiled()


def _python_ids(text: str, add_special_tokens: bool) -> list[int]:
    """:meth:`ByteTokenizer.encode` in Python: the compiled encode's specification."""
    ids = [BOS_ID] if add_special_tokens else []
    # Shift every byte by BYTE_OFFSET in C: UTF-8 never contains bytes above 0xF4, so a
    # byte table that adds 4 to 0..251 is exact (10x faster than a Python loop).
    ids.extend(text.encode("utf-8").translate(_SHIFTED))
    return ids


class ByteTokenizer:
    """One token per UTF-8 byte, plus four specials; needs no files.

    Invariants:
        1. ``encode(s)`` has exactly ``len(s.encode())`` ids, each ``byte + BYTE_OFFSET``.
        2. ``decode(encode(s)) == s`` for every ``str`` ``s``.
    """

    identity = "bytes-v1"
    vocab_size = 256 + BYTE_OFFSET
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    image_token_id = IMAGE_ID
    bos_token = ""
    eos_token = ""
    chat_template = None
    max_bytes_per_token = 1

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Return ``[BOS]`` (if asked) then one id per UTF-8 byte of ``text``."""
        if _compiled_ids is not None:  # the same list, built in C (3 µs less for 1,000 bytes)
            return _compiled_ids(text.encode("utf-8"), _BYTE_IDS,
                                 BOS_ID if add_special_tokens else None)
        return _python_ids(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids``; specials are dropped, broken UTF-8 becomes U+FFFD.

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``.
        """
        out = bytearray()
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is out of range [0, {self.vocab_size})")
            if i >= BYTE_OFFSET:
                out.append(i - BYTE_OFFSET)
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from local files.

    Build it with :func:`load_tokenizer`, which reads the files and reports their problems.
    """

    def __init__(
        self,
        raw: bytes,
        *,
        source: str,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        image_token: str | None = None,
    ) -> None:
        """Parse ``tokenizer.json`` bytes.

        Args:
            raw: the contents of ``tokenizer.json``.
            source: where they came from, for error messages and ``repr``.
            chat_template: the Jinja chat template, if any.
            bos_token: BOS as text (must be in the vocabulary when given).
            eos_token: EOS as text (must be in the vocabulary when given).
            image_token: the image placeholder token; when ``None`` a common one is looked up.

        Raises:
            ValueError: the file does not parse, or a named token is not in the vocabulary.
        """
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises bare Exception subclasses
            raise ValueError(f"cannot parse tokenizer file {source}: {e}") from e
        self._source = source
        self.chat_template = chat_template
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.bos_token_id = self._token_id(bos_token, "bos_token")
        self.eos_token_id = self._token_id(eos_token, "eos_token")
        if image_token is not None:
            image_id = self._token_id(image_token, "image_token")
        else:
            image_id = next(
                (i for t in _IMAGE_TOKEN_CANDIDATES if (i := self._tok.token_to_id(t)) is not None),
                None,
            )
        # A text-only tokenizer has no image token; any id serves as a placeholder, since image
        # positions are identified by content digest, never by this id. The unknown token is
        # the least misleading choice, else id 0.
        if image_id is None:
            image_id = self._tok.token_to_id("<unk>")
        self.image_token_id = 0 if image_id is None else image_id
        settings = json.dumps(
            [chat_template, self.bos_token, self.eos_token, self.image_token_id],
            separators=(",", ":"),
        ).encode()
        digest = hashlib.sha256()
        for part in (raw, settings):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
        self.identity = "hf:" + digest.hexdigest()[:16]
        #: The parsed ``tokenizer.json``, and the library's tokenizer built from it (for
        #: :mod:`openai_request.segment_cache`, which encodes segment by segment).
        self.spec: dict[str, Any] = json.loads(raw)
        self.backend = self._tok
        self.max_bytes_per_token = _max_bytes_per_token(self.spec)

    def _token_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{what} {token!r} is not in the vocabulary of {self._source}")
        return token_id

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Return the ids of ``text``; ``add_special_tokens`` runs the file's post-processor."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids``, special tokens dropped.

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``.
        """
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is out of range [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self._source!r}, identity={self.identity!r})"


#: Pre-tokenizers that keep every character of the text (note 5); ``Split`` and
#: ``Punctuation`` only while their behaviour is not ``Removed``.
_KEEPS_TEXT = ("ByteLevel", "Metaspace", "Digits", "Split", "Punctuation")


def _keeps_text(pre: Any) -> bool:
    if pre is None:
        return True
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers") or ())
    return pre.get("type") in _KEEPS_TEXT and pre.get("behavior") != "Removed"


def _never_shortens(normalizer: Any) -> bool:
    if normalizer is None:
        return True
    if not isinstance(normalizer, dict):
        return False
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_shortens(n) for n in normalizer.get("normalizers") or ())
    if kind == "Prepend":
        return True
    if kind == "Replace":  # a literal string by one at least as long (Llama's " " -> "▁")
        pattern = normalizer.get("pattern") or {}
        old, new = pattern.get("String"), normalizer.get("content")
        return (isinstance(old, str) and isinstance(new, str)
                and len(new.encode("utf-8")) >= len(old.encode("utf-8")))
    return False


def _max_bytes_per_token(spec: Any) -> int | None:
    """Note 5's bound for a parsed ``tokenizer.json``, or ``None`` when none is provable."""
    if not isinstance(spec, dict):
        return None
    model = spec.get("model")
    if (not _never_shortens(spec.get("normalizer")) or not _keeps_text(spec.get("pre_tokenizer"))
            or not isinstance(model, dict) or model.get("type") != "BPE"):
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk"):
        return None  # a run of unknown characters of any length may become one token
    longest = 4  # an unknown character (at most 4 bytes) may be one token
    for token in model.get("vocab") or {}:
        longest = max(longest, len(token.encode("utf-8")))
    for added in spec.get("added_tokens") or ():
        if added.get("lstrip") or added.get("rstrip"):
            return None  # it absorbs any number of spaces beside it
        longest = max(longest, len(str(added.get("content", "")).encode("utf-8")))
    return longest


def load_tokenizer(path: str | None) -> Tokenizer:
    """Load the tokenizer named by ``path``.

    Args:
        path: ``None`` for the byte-level tokenizer; a directory holding ``tokenizer.json``
            (and optionally ``tokenizer_config.json`` / ``chat_template.jinja``); the path
            of a ``tokenizer.json`` itself, whose directory is searched for the same extras;
            or a Hugging Face model id in the local cache
            (:mod:`openai_request.tokenizer_source`).

    Returns:
        The tokenizer.

    Raises:
        ValueError: the path does not exist, holds no ``tokenizer.json``, or a file in it is
            unreadable or malformed. The message names the path.
    """
    if path is None:
        return ByteTokenizer()
    p = resolve_tokenizer(path)
    if p.is_dir():
        file, folder = p / "tokenizer.json", p
    elif p.is_file():
        file, folder = p, p.parent
    else:
        raise ValueError(f"tokenizer path {path} does not exist")
    if not file.is_file():
        raise ValueError(f"tokenizer directory {path} has no tokenizer.json")
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read tokenizer file {file}: {e}") from e
    config = _read_config(folder / "tokenizer_config.json")
    template = _chat_template(config, folder)
    return HFTokenizer(
        raw,
        source=str(file),
        chat_template=template,
        bos_token=_token_text(config, "bos_token", folder),
        eos_token=_token_text(config, "eos_token", folder),
        image_token=_token_text(config, "image_token", folder),
    )


def _read_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read tokenizer config {file}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"tokenizer config {file} is not a JSON object")
    return config


def _chat_template(config: dict[str, Any], folder: Path) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read chat template {jinja_file}: {e}") from e
    template = config.get("chat_template")
    # Some configs hold a list of named templates; "default" is the one for plain chat.
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"chat_template in {folder / 'tokenizer_config.json'} is not a string")
    return template


def _token_text(config: dict[str, Any], key: str, folder: Path) -> str | None:
    value = config.get(key)
    # transformers writes special tokens either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} in {folder / 'tokenizer_config.json'} is not a string")
    return value
