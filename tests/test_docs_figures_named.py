"""Every table of measured figures in the docs names the command that prints it.

The rule, kept simple so a writer can apply it by eye:

- A *section* runs from a heading line (``#`` to ``######``) to the next heading of any level.
- A *table* is a run of lines starting with ``|`` whose second line is a separator
  (``| --- |``).
- A table holds *measured figures* when a cell below its header row (code spans left out)
  holds a number with a unit: ``ms``, ``µs``, ``us``, ``ns``, ``s``, ``min``, ``%``, ``tok/s``,
  ``req/s``, ``KB``/``MB``/``GB`` and their ``iB`` forms, or ``x`` or the multiplication
  sign (a ratio, ``2.1x``); or when a header cell gives the unit in parentheses
  (``TTFT p99 (s)``).
- Such a table passes when its section names a command: a code span (it may run over lines)
  or a fenced block's line that begins (after ``$``, and ``NAME=value`` settings) with
  ``python -m``, ``python3 -m``, ``.venv/bin/python -m``, ``kvroute``, ``make``, ``curl``,
  ``wrk`` or ``pytest`` and goes on (``kvroute router``, not the bare name ``kvroute``).
- A table of reference data, not measurements (flag defaults, settings, metric names, limits),
  opts out with the comment ``<!-- figures: reference -->`` on the line before it (blank lines
  between are allowed).

The commit a long measurement was taken at is asked of the writer, not checked here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
REFERENCE = "<!-- figures: reference -->"

_HEADING = re.compile(r"#{1,6} ")
_SEPARATOR = re.compile(r"\|\s*:?-{3,}")
_CODE_SPAN = re.compile(r"`+([^`]+)`+")
_UNIT_HEADER = re.compile(r"\((?:ms|µs|us|ns|s|min|%|tok/s|req/s|[KMG]i?B)\)")
_UNIT = r"(?:\s?(?:ms|µs|us|ns|s|min|tok/s|req/s|[KMG]i?B)\b|\s?%|[x\u00d7](?!\w))"
_FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?" + _UNIT)
_COMMAND = re.compile(r"^\$?\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
                      r"(?:(?:\.venv/bin/)?python3? -m |(?:kvroute|make|curl|wrk|pytest) \S)")


@dataclass(frozen=True)
class Unnamed:
    """A table of measured figures in a section that names no command."""

    doc: str
    line: int
    heading: str
    figure: str

    def __str__(self) -> str:
        return (f"{self.doc}:{self.line} ({self.heading!r}): a table of figures such as "
                f"{self.figure!r} and no command in its section")


def _commands(lines: list[str]) -> bool:
    """Whether ``lines`` (one section) name a command."""
    fenced = False
    prose = []
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            if _COMMAND.match(line.strip()):
                return True
        else:
            prose.append(line)
    spans = _CODE_SPAN.findall("\n".join(prose))
    return any(_COMMAND.match(" ".join(span.split())) for span in spans)


def _figure(header: str, rows: list[str]) -> str | None:
    """The first measured figure in a table's body rows (or the unit its header gives)."""
    unit = _UNIT_HEADER.search(_CODE_SPAN.sub("", header))
    if unit:
        return unit.group(0)
    for row in rows:
        found = _FIGURE.search(_CODE_SPAN.sub("", row))
        if found:
            return found.group(0)
    return None


def unnamed(text: str, doc: str = "doc") -> list[Unnamed]:
    """The tables of measured figures in ``text`` whose sections name no command."""
    lines = text.splitlines()
    sections: list[tuple[int, int]] = []  # (first line, end) of each section
    start = 0
    fenced = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and _HEADING.match(line) and i > start:
            sections.append((start, i))
            start = i
    sections.append((start, len(lines)))
    found = []
    for first, end in sections:
        section = lines[first:end]
        heading = section[0].lstrip("# ") if section and _HEADING.match(section[0]) else ""
        named = None
        i = 0
        while i < len(section):
            if not (section[i].startswith("|") and i + 1 < len(section)
                    and _SEPARATOR.match(section[i + 1])):
                i += 1
                continue
            table_end = i + 2
            while table_end < len(section) and section[table_end].startswith("|"):
                table_end += 1
            before = next((line for line in reversed(section[:i]) if line.strip()), "")
            figure = _figure(section[i], section[i + 2:table_end])
            if figure is not None and before.strip() != REFERENCE:
                if named is None:
                    named = _commands(section)
                if not named:
                    found.append(Unnamed(doc, first + i + 1, heading, figure))
            i = table_end
    return found


def test_every_table_of_figures_in_the_docs_names_its_command() -> None:
    problems = [str(p) for doc in DOCS for p in unnamed(doc.read_text(), doc.name)]
    assert problems == [], "\n".join(problems)


def test_the_rule_sees_figures_commands_and_the_reference_marker() -> None:
    table = "| case | p99 |\n| --- | --- |\n| kvroute | 43.6 ms |\n"
    assert [(p.line, p.heading, p.figure) for p in unnamed(f"# A\n\ntext\n\n{table}")] == [
        (5, "A", "43.6 ms")]
    for command in ("`python -m bench.router --quick`", "`make bench`", "`python -m\nbench.x`",
                    "```bash\n$ KVROUTE_SEED=3 python3 -m bench.replay\n```"):
        assert unnamed(f"# A\n\n{command} prints:\n\n{table}") == [], command
    # a bare name is no command; a command in another section does not count; the marker does
    assert len(unnamed(f"# A\n\nThe `kvroute` policy and `make`:\n\n{table}")) == 1
    assert len(unnamed(f"# A\n\n`make bench`\n\n# B\n\n{table}")) == 1
    assert unnamed(f"# B\n\n{REFERENCE}\n\n{table}") == []
    # numbers without units, units inside code spans and prose are not measured figures
    assert unnamed("# A\n\n| n | flag |\n| --- | --- |\n| 3 | `--timeout 5s` |\n") == []
    assert unnamed("# A\n\nit took 43.6 ms\n") == []
    for cell in ("2.1x", "3\u00d7", "12%", "1,024 tok/s", "3 GiB", "250 µs"):
        assert unnamed(f"# A\n\n| a |\n| --- |\n| {cell} |\n"), cell
    assert unnamed("# A\n\n| rate | p99 (s) |\n| --- | --- |\n| x12 | .113 |\n")
    # a heading inside a fenced block does not start a section
    assert unnamed(f"# A\n\n```bash\n# make bench prints\nmake bench\n```\n\n{table}") == []
