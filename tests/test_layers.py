"""Imports run down the layers only.

``native`` and ``indexer`` are the pure base; ``router`` and ``workers`` are two apps that
share that base and never import each other; ``kvroute`` (the command line) sits on top of
them, and ``bench`` on top of ``kvroute``: the command line reaches the benchmarks only through
one lazy ``importlib.import_module("bench.cli")``. Every import in every module counts, those
inside functions too.
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
    "openai_request": {"indexer", "native"},
    "httpapi": {"indexer", "native", "openai_request"},
    "router": {"indexer", "native", "openai_request", "httpapi"},
    "workers": {"indexer", "native", "openai_request", "httpapi"},
    "kvroute": {"indexer", "native", "openai_request", "httpapi", "router", "workers"},
    "bench": {"indexer", "native", "openai_request", "httpapi", "router", "workers", "kvroute"},
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


def test_the_command_line_reaches_the_benchmarks_through_one_lazy_entry_point() -> None:
    # Every bench module kvroute names, and every dynamic import it makes, with the function
    # it is made in: only the entry point, named once, imported inside main().
    named, lazy = [], []
    for path in sorted((REPO / "kvroute").rglob("*.py")):
        tree = ast.parse(path.read_text())
        named += [(path.name, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value.startswith("bench.")]
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            lazy += [(path.name, function.name, ast.unparse(call.args[0]))
                     for call in ast.walk(function) if isinstance(call, ast.Call)
                     and isinstance(call.func, ast.Attribute)
                     and call.func.attr == "import_module"]
        calls = [call for call in ast.walk(tree) if isinstance(call, ast.Call)
                 and isinstance(call.func, ast.Attribute) and call.func.attr == "import_module"]
        assert len(calls) == sum(1 for entry in lazy if entry[0] == path.name), path
    assert named == [("cli.py", "bench.cli")]
    assert lazy == [("cli.py", "main", "BENCH_ENTRY")]


#: The router's rooms, lowest first: a module may import its own room and the rooms below it.
ROUTER_ROOMS = ["routing", "events", "fleet", "service", "http", "epp"]
#: Top-level modules of ``router`` and the room they count as.
ROUTER_MODULES = {"service": "service", "settings": "service", "__init__": "service"}
#: Rooms that must do no I/O: they take values (times included) and return values.
PURE_ROOMS = {"router.routing", "indexer"}
IO_MODULES = {"asyncio", "zmq", "httpx", "aiohttp", "grpc", "time", "socket", "uvicorn",
              "starlette", "fastapi", "urllib.request", "subprocess", "threading"}


def router_room(module: str) -> str | None:
    """The room of a ``router.*`` module name, or None for a module outside ``router``."""
    parts = module.split(".")
    if parts[0] != "router" or len(parts) < 2:
        return None
    return ROUTER_MODULES.get(parts[1], parts[1])


def imported_modules(path: Path) -> set[str]:
    """Every module name the module at ``path`` imports, in full."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_router_has_its_rooms() -> None:
    rooms = {p.name for p in (REPO / "router").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(ROUTER_ROOMS) - {"service"}
    modules = {p.stem for p in (REPO / "router").glob("*.py")}
    assert modules == set(ROUTER_MODULES)


def test_router_rooms_import_only_themselves_and_the_rooms_below() -> None:
    wrong = {}
    for path in sorted((REPO / "router").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        room = router_room(module)
        if room is None:
            continue
        allowed = set(ROUTER_ROOMS[: ROUTER_ROOMS.index(room) + 1])
        above = {name for name in imported_modules(path)
                 if (r := router_room(name)) is not None and r not in allowed}
        if above:
            wrong[module] = sorted(above)
    assert wrong == {}


@pytest.mark.parametrize("room", sorted(PURE_ROOMS))
def test_pure_rooms_do_no_io(room: str) -> None:
    folder = REPO.joinpath(*room.split("."))
    wrong = {}
    for path in sorted(folder.rglob("*.py")):
        io = {name for name in imported_modules(path)
              if name in IO_MODULES or name.split(".")[0] in IO_MODULES}
        if io:
            wrong[str(path.relative_to(REPO))] = sorted(io)
    assert wrong == {}


#: The worker's rooms and what each may import of ``workers`` (besides itself), as
#: docs/design.md's map has them: ``cache`` at the bottom; ``engine`` on it; ``torch`` on both
#: and the settings; ``http`` on everything; ``settings`` reads the engine's timing, the
#: publisher's limits, the image policy's defaults and the image read-ahead's least bound;
#: ``runtime`` builds the engines.
WORKER_ROOMS: dict[str, set[str]] = {
    "cache": set(),
    "engine": {"workers.cache"},
    "torch": {"workers.cache", "workers.engine", "workers.settings"},
    "settings": {"workers.cache", "workers.engine", "workers.http.image_policy",
                 "workers.http.image_read_ahead"},
    "runtime": {"workers.cache", "workers.engine", "workers.torch", "workers.settings"},
    "http": {"workers.cache", "workers.engine", "workers.torch", "workers.runtime",
             "workers.settings"},
}


def worker_room(module: str) -> str | None:
    """The room of a ``workers.*`` module name (``workers.settings`` is its own), or None
    (``workers`` itself, a name outside it)."""
    parts = module.split(".")
    if parts[0] != "workers" or len(parts) < 2 or parts[1] == "__init__":
        return None
    return parts[1]


def test_the_workers_have_their_rooms() -> None:
    rooms = {p.name for p in (REPO / "workers").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (REPO / "workers").glob("*.py")} - {"__init__"}
    assert rooms | modules == set(WORKER_ROOMS)


def test_worker_rooms_import_only_what_the_map_allows() -> None:
    wrong = {}
    for path in sorted((REPO / "workers").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        room = worker_room(module)
        if room is None:
            continue
        allowed = WORKER_ROOMS[room] | {f"workers.{room}"}
        # ``from workers.cache import block_keys`` names the module ``workers.cache``.
        outside = {name for name in imported_modules(path)
                   if worker_room(name) not in (None, room)
                   and not any(name == a or name.startswith(f"{a}.") for a in allowed)
                   and not any(a.startswith(f"{name}.") for a in allowed)}
        if outside:
            wrong[module] = sorted(outside)
    assert wrong == {}
