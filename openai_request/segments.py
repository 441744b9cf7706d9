"""Where a Hugging Face tokenizer's text may be cut so that tokenizing the pieces one by one
gives exactly the ids of tokenizing it whole.

:func:`plan_splits` reads a ``tokenizer.json`` and returns a :class:`SplitPlan`, with notes on
the cuts it does not allow; :meth:`SplitPlan.split` cuts a text into segments by it. Two kinds
of cut are provable from the file alone:

1. **Around added tokens.** ``tokenizers`` first splits the text on its non-normalized added
   tokens (leftmost-longest), then normalizes, pre-tokenizes and models each piece on its
   own. Cutting at the same places is therefore exact, whatever the normalizer, provided every
   non-normalized added token is plain (no ``lstrip``, ``rstrip`` or ``single_word``, which
   absorb or look at their neighbours). The plan's regex lists them longest first, so Python's
   leftmost-first alternation picks the same match as the library's leftmost-longest one.
2. **Before a single space between two non-space characters** (``X Y``, cut before the
   space), where the pre-tokenizer provably breaks there in the whole and in the pieces, and
   the normalizer maps the two sides independently:

   - Byte-level's regexes (GPT-2's, and the Llama 3 / Qwen 2 ``Split`` patterns in
     :data:`PROVEN_REGEXES`): no alternative holds a space after a non-space character, so
     every match containing the space starts at it; none looks behind, so matching the piece
     from its start equals matching the whole from the cut; the one lookahead
     (``\\s+(?!\\S)``) only ever looks at whitespace, which ``X`` is not.
   - Metaspace, BERT's and the whitespace pre-tokenizers break at every space.
   - Normalizers that act per character (Unicode normal forms, lowercasing, BERT's, a
     one-character ``Replace`` of nothing spacing): a space is a starter, so nothing composes
     or reorders across it, and no non-space character normalizes to text ending in a space
     (checked over all of Unicode), which keeps the regex proof's ``X`` a non-space. BERT's
     spacing of CJK characters breaks that, so with it only pre-tokenizers that break at
     every whitespace are cut.
   - ``Prepend`` and Metaspace's ``prepend_scheme`` add a ``▁`` only to a piece that does not
     already start with one; a piece cut this way starts with a space, so it is encoded by
     the *continuing* encoder (the same file with those prepends turned off).

   A normalized added token holding whitespace could span such a cut, and one beside a
   prepend splits a segment into pieces that each get the prepend in the whole text, so
   either turns cuts at spaces off. The piece after an added token is encoded by the *fresh*
   encoder, except under Metaspace's ``prepend_scheme: first``, which prepends only at the
   text's start.

Anything else (truncation or padding in the file, an unknown normalizer, model or
pre-tokenizer, BPE dropout) keeps only the cuts it provably allows, possibly none: then the
text is one segment and the tokenizer encodes it whole. ``tests/openai_request/
test_segments.py`` checks equality with whole-text tokenization on random and adversarial
texts for byte-level BPE, Metaspace and WordPiece tokenizers.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["CONTINUED", "FRESH", "PROVEN_REGEXES", "Segment", "SplitPlan", "continuing_spec",
           "plan_splits", "special_tokens_frame"]

#: Encoders a segment may need: the file as it is, or with its prepends turned off.
FRESH = 0
CONTINUED = 1

#: ``Split`` pre-tokenizer regexes proven to break before a space between two non-spaces.
PROVEN_REGEXES = frozenset({
    # GPT-2 (ByteLevel's own, written out as a Split)
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    # Llama 3 and cl100k
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen 2
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
})

_PER_CHARACTER_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase",
                                        "BertNormalizer", "StripAccents", "Prepend"})
_BREAK_AT_SPACES = frozenset({"BertPreTokenizer", "Whitespace", "WhitespaceSplit"})
_SPLIT_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})
#: The cut: a space with a non-space on each side (Python's whitespace is a superset of
#: Rust's, so a non-space here is one there too).
_SPACE_CUT = re.compile(r"(?<=\S) (?=\S)")


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of text and how to encode it: ``token`` (an added token's id) or ``text``
    with ``encoder`` (:data:`FRESH` or :data:`CONTINUED`)."""

    text: str
    encoder: int
    token: int | None = None


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """The cuts one tokenizer allows (module docstring).

    Attributes:
        added: matches the plain non-normalized added tokens, longest first; ``None`` when
            cuts at added tokens are off.
        added_ids: each such token's id, by content.
        at_spaces: cuts before a space between non-spaces are on.
        after_added: the encoder of a piece that follows an added token.
        notes: why a kind of cut is off (empty when all are on), for the start-up log.
    """

    added: re.Pattern[str] | None
    added_ids: dict[str, int]
    at_spaces: bool
    after_added: int
    notes: tuple[str, ...] = ()

    @property
    def splits(self) -> bool:
        """Whether the plan cuts anything at all."""
        return self.added is not None or self.at_spaces

    def split(self, text: str, target: int) -> list[Segment]:
        """Cut ``text`` into segments, each cut at spaces after at least ``target``
        characters (so the cuts are a function of the text from the last added token on:
        a repeated prefix is cut the same way).

        Args:
            text: the text.
            target: the fewest characters between two cuts at spaces (at least 1).
        """
        out: list[Segment] = []
        pos, encoder = 0, FRESH
        if self.added is not None:
            for m in self.added.finditer(text):
                self._pieces(text, pos, m.start(), encoder, target, out)
                out.append(Segment(m.group(), FRESH, self.added_ids[m.group()]))
                pos, encoder = m.end(), self.after_added
        self._pieces(text, pos, len(text), encoder, target, out)
        return out

    def _pieces(self, text: str, start: int, end: int, encoder: int, target: int,
                out: list[Segment]) -> None:
        if start >= end:
            return
        if self.at_spaces:
            while end - start > target:
                cut = _SPACE_CUT.search(text, start + target, end)
                if cut is None:
                    break
                out.append(Segment(text[start:cut.start()], encoder))
                start, encoder = cut.start(), CONTINUED
        out.append(Segment(text[start:end], encoder))


def plan_splits(spec: dict[str, Any], added_tokens: dict[int, Any],
                encode_special_tokens: bool = False) -> SplitPlan:
    """Read the cuts a tokenizer allows from its parsed ``tokenizer.json``.

    Args:
        spec: the parsed file.
        added_tokens: the library's ``get_added_tokens_decoder()`` (id to ``AddedToken``).
        encode_special_tokens: the library's flag of that name (then specials are not split).
    """
    notes: list[str] = []
    if spec.get("truncation") or spec.get("padding"):
        return SplitPlan(None, {}, False, FRESH, ("the file truncates or pads",))
    plain: dict[str, int] = {}
    normalized = False
    unsafe_added = ""
    spaced_normalized = ""
    for token_id, token in added_tokens.items():
        if token.normalized:
            normalized = True
            if any(c.isspace() or c == "\u2581" for c in token.content):
                spaced_normalized = token.content
            continue
        if token.lstrip or token.rstrip or token.single_word:
            unsafe_added = token.content
        plain[token.content] = token_id
    if encode_special_tokens:
        return SplitPlan(None, {}, False, FRESH, ("special tokens are encoded as text",))
    if unsafe_added:  # its stripped spaces could be cut from it, too
        return SplitPlan(None, {}, False, FRESH,
                         (f"added token {unsafe_added!r} strips or matches words",))
    added: re.Pattern[str] | None = None
    if plain:
        ordered = sorted(plain, key=len, reverse=True)
        added = re.compile("|".join(re.escape(t) for t in ordered))
    at_spaces = True
    for reason in (_normalizer_problem(spec.get("normalizer")),
                   _pre_tokenizer_problem(spec.get("pre_tokenizer")),
                   _model_problem(spec.get("model"))):
        if reason:
            notes.append(reason)
            at_spaces = False
    if at_spaces and _spaces_at_ends(spec.get("normalizer")) and _regex_breaks(
            spec.get("pre_tokenizer")):
        notes.append("the normalizer may add spaces that a regex pre-tokenizer joins")
        at_spaces = False
    if at_spaces and normalized and continuing_spec(spec) is not None:
        # A normalized added token splits the text inside a segment, and the piece after it
        # gets the prepend in the whole text but not from the continuing encoder.
        notes.append("normalized added tokens beside a prepending normalizer or pre-tokenizer")
        at_spaces = False
    if spaced_normalized:
        notes.append(f"normalized added token {spaced_normalized!r} holds a space")
        at_spaces = False
    first = _metaspace_schemes(spec.get("pre_tokenizer")) & {"first"}
    return SplitPlan(added, plain if added is not None else {}, at_spaces,
                     CONTINUED if first else FRESH, tuple(notes))


def continuing_spec(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The file with every prepend turned off, for segments cut before a space; ``None``
    when it has none (the fresh encoder serves)."""
    out = copy.deepcopy(spec)
    changed = False

    def normalizer(n: Any) -> Any:
        nonlocal changed
        if not isinstance(n, dict):
            return n
        if n.get("type") == "Prepend":
            changed = True
            return None
        if n.get("type") == "Sequence":
            kept = [m for m in (normalizer(m) for m in n.get("normalizers") or ()) if m]
            return {**n, "normalizers": kept}
        return n

    def pre_tokenizer(p: Any) -> Any:
        nonlocal changed
        if not isinstance(p, dict):
            return p
        kind = p.get("type")
        if kind == "Sequence":
            return {**p, "pretokenizers": [pre_tokenizer(q) for q in p.get("pretokenizers") or ()]}
        if kind == "Metaspace" and (p.get("prepend_scheme", "always") != "never"
                                    or p.get("add_prefix_space")):
            changed = True
            p = {**p, "prepend_scheme": "never"}
            if "add_prefix_space" in p:
                p["add_prefix_space"] = False
            return p
        if kind == "ByteLevel" and p.get("add_prefix_space"):
            changed = True
            return {**p, "add_prefix_space": False}
        return p

    out["normalizer"] = normalizer(out.get("normalizer"))
    out["pre_tokenizer"] = pre_tokenizer(out.get("pre_tokenizer"))
    return out if changed else None


def _normalizer_problem(n: Any) -> str:
    if n is None:
        return ""
    if not isinstance(n, dict):
        return "the normalizer is unreadable"
    kind = n.get("type")
    if kind == "Sequence":
        return next((r for m in n.get("normalizers") or () if (r := _normalizer_problem(m))), "")
    if kind == "Replace":
        # A one-character pattern, and nothing spacing: replacing the cut's space (by "▁")
        # would let a regex join it to the character before.
        old, new = (n.get("pattern") or {}).get("String"), n.get("content")
        if (isinstance(old, str) and len(old) == 1 and isinstance(new, str)
                and not any(c.isspace() or c == "\u2581" for c in old + new)):
            return ""
        return "the normalizer replaces more than one character, or spaces"
    if kind in _PER_CHARACTER_NORMALIZERS:
        return ""
    return f"normalizer {kind} may act across spaces"


def _spaces_at_ends(n: Any) -> bool:
    """Whether the normalizer may end a non-space character's text with a space (BERT's
    spacing of CJK characters; no Unicode normal form does)."""
    if not isinstance(n, dict):
        return False
    if n.get("type") == "Sequence":
        return any(_spaces_at_ends(m) for m in n.get("normalizers") or ())
    return n.get("type") == "BertNormalizer" and n.get("handle_chinese_chars", True) is not False


def _pre_tokenizer_problem(p: Any) -> str:
    """Empty when the pre-tokenizer provably breaks before a space between non-spaces."""
    breaks, problem = _pre_tokenizer(p)
    if problem:
        return problem
    return "" if breaks else "the pre-tokenizer does not break at spaces"


def _pre_tokenizer(p: Any) -> tuple[bool, str]:
    """Whether ``p`` breaks at the cut, and what makes it unsafe ("" when nothing does)."""
    if p is None:
        return False, ""
    if not isinstance(p, dict):
        return False, "the pre-tokenizer is unreadable"
    kind = p.get("type")
    if kind == "Sequence":
        breaks = False
        for q in p.get("pretokenizers") or ():
            b, problem = _pre_tokenizer(q)
            if problem:
                return False, problem
            breaks = breaks or b
        return breaks, ""
    if kind == "ByteLevel":
        return bool(p.get("use_regex", True)), ""
    if kind == "Metaspace":
        return bool(p.get("split", True)), ""
    if kind in _BREAK_AT_SPACES:
        return True, ""
    if kind in ("Digits", "Punctuation"):
        return False, "" if p.get("behavior", "Isolated") == "Isolated" else f"{kind} merges"
    if kind == "Split":
        regex = (p.get("pattern") or {}).get("Regex")
        if (regex in PROVEN_REGEXES and p.get("behavior") == "Isolated"
                and not p.get("invert")):
            return True, ""
        return False, "the Split pre-tokenizer's pattern is not a proven one"
    return False, f"pre-tokenizer {kind} is not known to break at spaces"


def _regex_breaks(p: Any) -> bool:
    """Whether the pre-tokenizer breaks by a regex (whose proof needs the character before a
    cut to stay a non-space), not at every whitespace."""
    if not isinstance(p, dict):
        return False
    if p.get("type") == "Sequence":
        return any(_regex_breaks(q) for q in p.get("pretokenizers") or ())
    return p.get("type") == "Split" or (p.get("type") == "ByteLevel"
                                        and bool(p.get("use_regex", True)))


def _model_problem(model: Any) -> str:
    if not isinstance(model, dict) or model.get("type") not in _SPLIT_MODELS:
        return "the model is of an unknown kind"
    if model.get("type") == "BPE" and model.get("dropout"):
        return "BPE dropout is on"
    return ""


def _metaspace_schemes(p: Any) -> set[str]:
    if not isinstance(p, dict):
        return set()
    if p.get("type") == "Sequence":
        return set().union(*(_metaspace_schemes(q) for q in p.get("pretokenizers") or ()))
    if p.get("type") == "Metaspace":
        return {str(p.get("prepend_scheme", "always"))}
    return set()


def special_tokens_frame(encode: Any) -> tuple[list[int], list[int]] | None:
    """The ids a post-processor puts before and after a single text when special tokens are
    asked for, found by encoding two probes; ``None`` when it does more than frame the text.

    Args:
        encode: ``(text, add_special_tokens) -> ids``.
    """
    frames = []
    for probe in ("kvroute probe", "a second, longer probe text 12345"):
        plain, special = encode(probe, False), encode(probe, True)
        for k in range(len(special) - len(plain) + 1):
            if special[k:k + len(plain)] == plain:
                frames.append((special[:k], special[k + len(plain):]))
                break
        else:
            return None
    return frames[0] if frames[0] == frames[1] else None
