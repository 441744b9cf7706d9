"""Every module, file and name the docs point at exists.

The docs are README.md and docs/*.md. What they name is checked by these conventions, kept to
what can be checked without false alarms (anything outside them is not checked):

1. **Paths.** A code span (single backticks) that is a path under one of the project's
   top-level folders (``router/http/flow.py``, ``bench/data/``, ``deploy/k8s/base``) names a
   file or folder that exists. A span holding anything but letters, digits, ``_ . / -`` (a
   glob, a placeholder, a command line) is not a path; ``:LINE`` after a path is dropped.
2. **Dotted modules.** A code span that is a dotted name starting with a project package
   (``router.routing.scheduler``, ``bench.sim.Regret``, ``router.routing.core.CoreSettings``)
   names a module, and what follows the longest module prefix names a top-level definition in
   it (class, function, assignment or import), then an attribute defined in that class's
   body (method, property, field). ``python -m NAME`` in a code span or a fenced block names
   a module or package that exists.
3. **A name beside its module.** A code span holding ``Name`` or ``Name.attr`` right next to
   a span of rule 1 or 2 (only spaces, or a comma and a space, between them, either order:
   ``router/service.py`` ``RouterService.decide``, ``RoutingCore.passed_on``,
   ``router/routing/core.py``) names a top-level definition of that module, then an
   attribute of it as in rule 2.
4. **A class's attribute anywhere.** A code span ``Class.attr`` whose ``Class`` is defined
   in exactly one module of the project names an attribute defined in that class's body (or
   one of its bases defined in the project). A class defined nowhere in the project, or in
   several modules, is not checked (it may be a peer's or a library's).
5. **Links.** A Markdown link to a relative path (``[wire.md](wire.md#the-image-routing-
   extension)``) names a file that exists, relative to the doc; a ``#anchor`` into a .md
   file names one of its headings, slugged as GitHub does (lower case, spaces to ``-``,
   punctuation other than ``-`` and ``_`` dropped).

"Defined" is read from the source with :mod:`ast`, nothing is imported: a module's top-level
``def``, ``class``, assignment, annotated assignment, ``import`` and ``from ... import``
names; a class body's ``def``, assignments and annotated fields, and what its methods
assign on ``self``; a Cython ``.pyx`` counts as
its module but its names are not read (spans into it are not checked beyond the module).
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("router", "workers", "indexer", "openai_request", "httpapi", "kvroute", "native",
            "bench", "tests", "e2e")
FOLDERS = (*PACKAGES, "deploy", "docs", ".ci")

_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_PATH = re.compile(r"(?:{})(?:/[\w.-]+)*/?".format("|".join(map(re.escape, FOLDERS))))
_DOTTED = re.compile(r"(?:{})(?:\.[A-Za-z_]\w*)+".format("|".join(PACKAGES)))
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?")
_CLASS_ATTR = re.compile(r"([A-Z]\w*)\.([A-Za-z_]\w*)")
_RUN_MODULE = re.compile(r"python3? -m ([\w.]+)")
_BETWEEN = re.compile(r"(?: +|, )")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CLASS_LINE = re.compile(r"^class\s+([A-Za-z_]\w*)", re.MULTILINE)


@dataclass(frozen=True)
class Problem:
    """One thing a doc names that does not exist."""

    doc: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.what}"


def _prose(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, numbered from 1."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((i, line))
    return out


def _fenced(text: str) -> list[tuple[int, str]]:
    """The lines inside fenced blocks, numbered from 1."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            out.append((i, line))
    return out


def _module_file(dotted: str) -> Path | None:
    """The source file of the project module ``dotted`` (a package's ``__init__.py``)."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base.with_suffix(".pyx")):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _tree(path: Path) -> ast.Module | None:
    if path.suffix != ".py":
        return None
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """The names a module or class body defines, each with the statement defining it."""
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target,
                                                                           ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try):
            # `if TYPE_CHECKING:` and `try: import x except ImportError: ...` blocks
            inner = [*node.body, *getattr(node, "orelse", []),
                     *[s for h in getattr(node, "handlers", []) for s in h.body],
                     *getattr(node, "finalbody", [])]
            names.update(_names(inner))
    return names


@functools.cache
def _class_lines() -> dict[str, list[Path]]:
    """The project's files by the names of the ``class`` lines they hold at column 0: every
    file defining a top-level class of that name is among them (a docstring's line may add
    one the syntax tree then leaves out). Only those files are parsed: parsing the whole
    project (about 3 MB of source) took most of the check's time."""
    found: dict[str, list[Path]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for name in dict.fromkeys(_CLASS_LINE.findall(text)):
                found.setdefault(name, []).append(path)
    return found


@functools.cache
def _classes(name: str) -> list[tuple[Path, ast.ClassDef]]:
    """Every class called ``name`` the project's packages define at a module's top level."""
    found = []
    for path in _class_lines().get(name, []):
        tree = _tree(path)
        assert tree is not None, f"{path} is Python source"
        found += [(path, node) for node in tree.body
                  if isinstance(node, ast.ClassDef) and node.name == name]
    return found


def _instance_names(node: ast.ClassDef) -> set[str]:
    """The attributes the class's methods assign on ``self``."""
    return {target.attr for target in ast.walk(node)
            if isinstance(target, ast.Attribute) and isinstance(target.ctx, ast.Store)
            and isinstance(target.value, ast.Name) and target.value.id == "self"}


def _class_has(node: ast.ClassDef, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether the class ``node``, or a base of it defined in the project, defines ``attr``."""
    if attr in _names(node.body) or attr in _instance_names(node):
        return True
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if name is None or name in seen:
            continue
        if not isinstance(base, ast.Name | ast.Attribute):
            continue
        homes = _classes(name)
        if not homes:
            return True  # a base from outside the project: it may define anything
        if any(_class_has(home, attr, seen | {node.name}) for _, home in homes):
            return True
    return False


def _lookup(path: Path, names: list[str]) -> str | None:
    """What of ``names`` (a top-level name, then an attribute) the module lacks, or None."""
    tree = _tree(path)
    if tree is None or not names:
        return None
    defined = _names(tree.body)
    node = defined.get(names[0])
    if node is None:
        return f"{names[0]} is not defined in {path.relative_to(ROOT)}"
    if len(names) > 1 and isinstance(node, ast.ClassDef) and not _class_has(node, names[1]):
        return f"{names[0]} in {path.relative_to(ROOT)} has no {names[1]}"
    return None


def _dotted(dotted: str) -> tuple[Path | None, list[str]]:
    """The longest module prefix of ``dotted`` and the names after it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is not None:
            return path, parts[cut:]
    return None, parts


def _module_of(span: str) -> Path | None:
    """The module a path or dotted span names, if it names one."""
    if _PATH.fullmatch(span) and span.endswith((".py", ".pyx")):
        path = ROOT / span
        return path if path.is_file() else None
    if _DOTTED.fullmatch(span):
        path, rest = _dotted(span)
        return path if not rest else None
    return None


def _slug(heading: str) -> str:
    text = re.sub(r"`|\*\*?|<[^>]+>", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    return frozenset(_slug(line.lstrip("#")) for _, line in _prose(path.read_text())
                     if re.match(r"#{1,6} ", line))


def problems(doc: Path, text: str | None = None) -> list[Problem]:
    """Everything ``doc`` names, by the conventions above, that does not exist.

    Args:
        doc: the doc's path (links are resolved from its folder).
        text: its text, when not the file's.
    """
    if text is None:
        text = doc.read_text(encoding="utf-8")
    name = doc.relative_to(ROOT).as_posix()
    found: list[Problem] = []
    for number, line in _prose(text):
        spans = list(_SPAN.finditer(line))
        for i, match in enumerate(spans):
            span = match.group(1).strip()
            path_span = re.sub(r":\d+$", "", span)
            if _PATH.fullmatch(path_span) and "/" in path_span:
                if not (ROOT / path_span).exists():
                    found.append(Problem(name, number, f"`{span}`: no such file or folder"))
                continue
            if _DOTTED.fullmatch(span):
                path, rest = _dotted(span)
                if path is None:
                    found.append(Problem(name, number, f"`{span}`: no such module"))
                else:
                    missing = _lookup(path, rest[:2])
                    if missing:
                        found.append(Problem(name, number, f"`{span}`: {missing}"))
                continue
            for module in _RUN_MODULE.findall(span):
                if _module_file(module) is None and module.split(".")[0] in PACKAGES:
                    found.append(Problem(name, number, f"`{span}`: no module {module}"))
            if not _NAME.fullmatch(span) or span.split(".")[0] in PACKAGES:
                continue
            neighbours = []
            if i > 0 and _BETWEEN.fullmatch(line[spans[i - 1].end():match.start()]):
                neighbours.append(spans[i - 1].group(1).strip())
            if i + 1 < len(spans) and _BETWEEN.fullmatch(line[match.end():spans[i + 1].start()]):
                neighbours.append(spans[i + 1].group(1).strip())
            modules = [m for m in map(_module_of, neighbours) if m is not None]
            if modules:
                if all(_lookup(m, span.split(".")) for m in modules):
                    found.append(Problem(name, number,
                                         f"`{span}`: " + _lookup(modules[0], span.split("."))))
                continue
            attr = _CLASS_ATTR.fullmatch(span)
            homes = _classes(attr.group(1)) if attr else []
            if attr and len({p for p, _ in homes}) == 1 and not _class_has(homes[0][1],
                                                                           attr.group(2)):
                found.append(Problem(name, number, f"`{span}`: {attr.group(1)} in "
                                     f"{homes[0][0].relative_to(ROOT)} has no {attr.group(2)}"))
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                found.append(Problem(name, number, f"link to {target}: no such file"))
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                found.append(Problem(name, number, f"link to {target}: no such heading"))
    for number, line in _fenced(text):
        for module in _RUN_MODULE.findall(line):
            if module.split(".")[0] in PACKAGES and _module_file(module) is None:
                found.append(Problem(name, number, f"python -m {module}: no such module"))
    return found


def test_every_path_module_and_name_the_docs_give_exists() -> None:
    found = [str(p) for doc in DOCS for p in problems(doc)]
    assert found == [], "\n".join(found)


def test_the_conventions_see_what_is_missing_and_pass_what_is_there() -> None:
    doc = ROOT / "docs" / "example.md"

    def found(text: str) -> list[str]:
        return [p.what for p in problems(doc, text)]

    there = ("`router/routing/core.py`, `bench/data/`, `router/service.py:12`, "
             "`router.routing.core.CoreSettings`, `router/service.py` `RouterService.decide`, "
             "(`RoutingCore.passed_on`, `router/routing/core.py`), `LoadTracker.stored`, "
             "`python -m bench.replay --quick`, [design](design.md#block-identity), "
             "[up](../README.md), `Request.url`, `path/to/file.py`, `router/*.py`, "
             "`--policy` `kv`, `self.x`")
    assert found(f"# A\n\n{there}\n\n```\npython -m bench.sim\n```\n") == []
    assert found("`router/routing/nothing.py`") == [
        "`router/routing/nothing.py`: no such file or folder"]
    assert found("`router.routing.nothing`") == [
        "`router.routing.nothing`: nothing is not defined in router/routing/__init__.py"]
    assert found("`router.routing.core.Nothing`") == [
        "`router.routing.core.Nothing`: Nothing is not defined in router/routing/core.py"]
    assert found("`router/service.py` `RouterService._gone`") == [
        "`RouterService._gone`: RouterService in router/service.py has no _gone"]
    assert found("`RoutingCore.gone`") == [
        "`RoutingCore.gone`: RoutingCore in router/routing/core.py has no gone"]
    assert found("`python -m bench.nothing`") == [
        "`python -m bench.nothing`: no module bench.nothing"]
    assert found("```\npython -m router.nothing --x\n```") == [
        "python -m router.nothing: no such module"]
    assert found("[a](nothing.md) [b](design.md#no-such-heading)") == [
        "link to nothing.md: no such file", "link to design.md#no-such-heading: no such heading"]
