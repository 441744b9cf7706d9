"""No module of the project imports another module's private names: a name that starts with
one underscore is the business of the module that defines it. Helpers that several modules
share are public, in a module named for what they do (``bench/replay_setup.py`` holds what the
replay benchmarks build from their arguments).

``tests/`` and ``e2e/`` are exempt: a unit test may reach into the module it tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: The packages the rule holds for: everything that ships (pyproject's packages).
PACKAGES = ["native", "indexer", "openai_request", "httpapi", "router", "workers", "kvroute",
            "bench"]


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path) -> list[str]:
    """``from MODULE import _NAME`` lines of the module at ``path``, as ``MODULE._NAME``
    (relative imports included: a sibling module's private name is still not its own)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found += [f"{module}.{a.name}".replace("..", ".") for a in node.names
                      if private(a.name)]
    return found


@pytest.mark.parametrize("package", [p for p in PACKAGES if (REPO / p).is_dir()])
def test_no_module_imports_another_modules_private_names(package: str) -> None:
    wrong = {str(path.relative_to(REPO)): names
             for path in sorted((REPO / package).rglob("*.py"))
             if (names := private_imports(path))}
    assert wrong == {}


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from bench.replay import build_parser, _hidden\n"
                      "def f():\n    from .flow import _pct\n")
    assert private_imports(module) == ["bench.replay._hidden", ".flow._pct"]
