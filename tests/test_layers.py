"""Imports run down the layers only.

``native`` and ``indexer`` are the pure base; ``router`` and ``workers`` are two apps that
share that base and never import each other; ``kvroute`` (the command line) and ``bench`` sit
on top. Every import in every module counts, those inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: What each top-level package may import from the project (besides itself).
ALLOWED: dict[str, set[str]] = {
    "native": set(),
    "indexer": {"native"},
    "httpapi": {"indexer", "native"},
    "router": {"indexer", "native", "httpapi"},
    "workers": {"indexer", "native", "httpapi"},
    "kvroute": {"indexer", "native", "httpapi", "router", "workers", "bench"},
    "bench": {"indexer", "native", "httpapi", "router", "workers", "kvroute"},
}
PROJECT = set(ALLOWED) | {"tests", "e2e"}


def imported_packages(path: Path) -> set[str]:
    """The project's top-level packages that the module at ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & PROJECT
    return found


@pytest.mark.parametrize("package", sorted(p for p in ALLOWED if (REPO / p).is_dir()))
def test_imports_run_down_the_layers(package: str) -> None:
    wrong = {}
    for path in sorted((REPO / package).rglob("*.py")):
        extra = imported_packages(path) - ALLOWED[package] - {package}
        if extra:
            wrong[str(path.relative_to(REPO))] = sorted(extra)
    assert wrong == {}


def test_the_command_line_imports_the_benchmarks_only_inside_functions() -> None:
    for path in sorted((REPO / "kvroute").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                assert "bench" not in imported_packages_of(node), path


def imported_packages_of(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    return {node.module.split(".")[0]} if node.module and node.level == 0 else set()
