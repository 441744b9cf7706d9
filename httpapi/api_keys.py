"""Client API keys: the keys clients present on ``/v1/*``, kept as salted hashes.

A keys file (``--api-keys-file``, or the same lines in ``KVROUTE_API_KEYS``) holds one key a
line, as ``kvroute keys hash`` prints it::

    sha256$<salt, 32 hex>$<sha256(salt || key), 64 hex> id=<12 hex> name=alice tpm=200000

``id`` is the first 12 hex digits of the key's unsalted SHA-256, which finds its entry
without trying every salt; ``name`` (letters, digits, ``._-``, at most 64) labels the key's
metrics, and a key without one is counted as ``other``. ``tpm`` is the key's prompt tokens
per minute (0: no limit; absent: the router's ``--api-key-tokens-per-minute``). ``#`` starts
a comment; in the environment ``;`` separates lines.

A key is looked for in ``Authorization: Bearer <key>`` and, for Anthropic's clients, in
``x-api-key``. The hash is SHA-256, salted per key, and not a slow password hash (scrypt,
argon2): the keys ``kvroute keys hash --generate`` makes carry 256 random bits, which no
guessing reaches, and a slow hash would cost every request, or every unknown key a client
sends, its full price once per configured key. Each key found is remembered under its
unsalted digest (in memory only), so a known key costs one SHA-256 and a look-up. A key not
remembered is hashed with the salt of each entry its ``id`` names, and of each entry without
an ``id``, and compared with :func:`hmac.compare_digest`, every such entry compared, so the
time says nothing about how much of one matched. With every line carrying its ``id``, an
unknown key costs 0.6 µs of CPU among 1,000 keys, against 424 µs when every salt is tried
(``python -m bench.api_keys`` on the 2-core VM): without ids, a client sending made-up keys
would buy the router's CPU cheaply. The ``id`` gives away 48 bits of
an unsalted hash: nothing to a generated key's 256, and a key a person chose is as guessable
from the salted hash, as fast to compute.

Pure: text in, entries out; no file or socket here (the settings read the file).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["OTHER", "ApiKey", "KeyRing", "generate_key", "hash_line", "parse_keys",
           "presented_key"]

#: The metrics label of a key that has no name.
OTHER = "other"
_SCHEME = "sha256"
_LINE = re.compile(r"sha256\$([0-9a-f]{32})\$([0-9a-f]{64})")
_ID = re.compile(r"[0-9a-f]{12}")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: Remembered keys at most: each a key that matched an entry, so bounded by the entries too.
_MAX_REMEMBERED = 65536


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One configured key: its salted hash, its name (``None``: counted as ``other``), its
    prompt tokens per minute (``None``: the router's default; 0: no limit) and its look-up
    id (``None``: found by trying its salt on every unknown key)."""

    salt: bytes
    digest: bytes
    name: str | None = None
    tokens_per_minute: int | None = None
    key_id: str | None = None

    @property
    def label(self) -> str:
        """The key's metrics label: its name, or ``other``; never the key."""
        return self.name if self.name is not None else OTHER

    def matches(self, key: bytes) -> bool:
        """Whether ``key`` hashes, with this entry's salt, to its digest (constant time)."""
        return hmac.compare_digest(hashlib.sha256(self.salt + key).digest(), self.digest)


def generate_key() -> str:
    """A new random key: ``kvr-`` and 43 URL-safe characters (256 bits)."""
    return "kvr-" + secrets.token_urlsafe(32)


def hash_line(key: str, name: str | None = None, tokens_per_minute: int | None = None,
              salt: bytes | None = None) -> str:
    """The keys file's line for ``key`` (a new random salt unless ``salt`` is given).

    Raises:
        ValueError: an empty key, a malformed name or a negative rate.
    """
    if not key:
        raise ValueError("the key is empty")
    if name is not None and not _NAME.fullmatch(name):
        raise ValueError(f"name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
    if tokens_per_minute is not None and tokens_per_minute < 0:
        raise ValueError("tpm must be >= 0")
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.sha256(salt + key.encode()).hexdigest()
    line = f"{_SCHEME}${salt.hex()}${digest} id={_key_id(hashlib.sha256(key.encode()).digest())}"
    if name is not None:
        line += f" name={name}"
    if tokens_per_minute is not None:
        line += f" tpm={tokens_per_minute}"
    return line


def _key_id(unsalted: bytes) -> str:
    return unsalted.hex()[:12]


def parse_keys(text: str, origin: str = "api keys") -> list[ApiKey]:
    """The entries of a keys file's ``text`` (newlines or ``;`` between lines).

    Raises:
        ValueError: a line that is not ``sha256$SALT$DIGEST [id=ID] [name=NAME] [tpm=N]``, a
            name given twice, or no key at all; the message names the line, never its hash.
    """
    keys: list[ApiKey] = []
    names: set[str] = set()
    for number, raw in enumerate(re.split(r"[;\n]", text), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        first, *options = line.split()
        found = _LINE.fullmatch(first)
        if found is None:
            raise ValueError(f"{origin}, line {number}: not sha256$SALT$DIGEST (the line "
                             "'kvroute keys hash' prints)")
        name: str | None = None
        tpm: int | None = None
        key_id: str | None = None
        for option in options:
            field, _, value = option.partition("=")
            if field == "name" and _NAME.fullmatch(value):
                name = value
            elif field == "tpm" and value.isdigit():
                tpm = int(value)
            elif field == "id" and _ID.fullmatch(value):
                key_id = value
            else:
                raise ValueError(f"{origin}, line {number}: {option!r} is not id=ID, "
                                 "name=NAME or tpm=TOKENS_PER_MINUTE")
        if name is not None:
            if name in names:
                raise ValueError(f"{origin}, line {number}: the name {name!r} is taken")
            names.add(name)
        keys.append(ApiKey(bytes.fromhex(found[1]), bytes.fromhex(found[2]), name, tpm,
                           key_id))
    if not keys:
        raise ValueError(f"{origin} holds no key")
    return keys


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: ``Authorization: Bearer KEY``, else ``x-api-key: KEY``
    (headers named in lower case); ``None`` when it presents none."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, key = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return key.strip()
    key = (headers.get("x-api-key") or "").strip()
    return key or None


class KeyRing:
    """The configured keys, and which one a request presents (module docstring).

    Args:
        keys: the entries (:func:`parse_keys`).
    """

    __slots__ = ("_by_id", "_known", "_unnamed", "keys")

    def __init__(self, keys: list[ApiKey]) -> None:
        if not keys:
            raise ValueError("a key ring needs a key")
        self.keys = tuple(keys)
        self._known: dict[bytes, ApiKey] = {}
        self._by_id: dict[str, list[ApiKey]] = {}
        for k in keys:
            if k.key_id is not None:
                self._by_id.setdefault(k.key_id, []).append(k)
        #: The entries without an id, tried on every key not found otherwise.
        self._unnamed = [k for k in keys if k.key_id is None]

    def identify(self, key: str) -> ApiKey | None:
        """The entry ``key`` matches, or ``None``."""
        raw = key.encode()
        seen = hashlib.sha256(raw).digest()
        entry = self._known.get(seen)
        if entry is not None:
            return entry
        found = None
        candidates = [*self._by_id.get(_key_id(seen), ()), *self._unnamed]
        for candidate in candidates:  # every one, whatever matched
            if candidate.matches(raw):
                found = candidate
        if found is not None:
            if len(self._known) >= _MAX_REMEMBERED:
                self._known.clear()
            self._known[seen] = found
        return found
