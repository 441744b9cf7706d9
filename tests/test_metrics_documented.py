"""Every metric family the router and the worker export is in docs/operations.md, and every
family listed there is exported: the tables are the reference an operator builds alerts on."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.exported import exported, router_exposition, worker_exposition

DOC = Path(__file__).parent.parent / "docs" / "operations.md"
_NAME = re.compile(r"`((?:kvroute|inference_pool)_[a-z0-9_]+)(?:\{[^}`]*\})?`")


def documented(section: str) -> dict[str, str]:
    """The families in a metrics table of ``### section``, each with its row's engine column
    (``all`` where the table has none)."""
    text = DOC.read_text()
    body = text.split(f"### {section}\n", 1)[1].split("\n#", 1)[0]
    found: dict[str, str] = {}
    for row in body.splitlines():
        if not row.startswith("| `"):
            continue
        cells = [c.strip() for c in row.strip("|").split("|")]
        engine = cells[2] if len(cells) == 4 else "all"
        for name in _NAME.findall(cells[0]):
            found[name] = engine
    return found


def test_every_router_family_is_documented_and_every_documented_one_exported() -> None:
    names = exported(router_exposition())
    docs = set(documented("Router"))
    assert names - docs == set(), "exported but not in docs/operations.md"
    assert docs - names == set(), "in docs/operations.md but not exported"


async def test_every_worker_family_is_documented_and_every_documented_one_exported() -> None:
    names = exported(await worker_exposition())
    docs = documented("Worker")
    assert names - set(docs) == set(), "exported but not in docs/operations.md"
    everywhere = {n for n, engine in docs.items() if engine == "all"}
    assert everywhere - names == set(), "in docs/operations.md but not exported"


def test_the_documentation_check_reads_the_tables() -> None:
    # The parser finds label sets, several names in a cell, and the engine column.
    router, worker = documented("Router"), documented("Worker")
    assert "kvroute_upstream_failures_total" in router and "kvroute_router_seconds" in router
    assert worker["kvroute_worker_waiting"] == "all"
    assert worker["kvroute_worker_memory_kv_bytes"] == "torch"
    assert exported("# TYPE a_total counter\na_total 1\n# TYPE b histogram\n") == {"a_total",
                                                                                   "b"}
