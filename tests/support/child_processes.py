"""Child processes refused while a test without the ``process`` marker runs (the top-level
``conftest.py`` wraps each such test's setup, call and teardown in :func:`no_child_processes`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from typing import Any

__all__ = ["UnmarkedProcess", "message", "no_child_processes"]


class UnmarkedProcess(AssertionError):
    """A test without the ``process`` marker started a child process."""


@contextlib.contextmanager
def no_child_processes(nodeid: str) -> Iterator[list[str]]:
    """Refuse every child process started meanwhile (``subprocess``, ``asyncio``'s
    subprocesses, ``os.fork``, ``os.posix_spawn``): each raises :class:`UnmarkedProcess`
    and is remembered in the list yielded, so a caller that swallows the error cannot hide
    it."""
    attempts: list[str] = []

    def refuse(what: str) -> None:
        attempts.append(what)
        raise UnmarkedProcess(message(nodeid, what))

    original = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    fork, spawn, spawnp = os.fork, os.posix_spawn, os.posix_spawnp

    def execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        if _library_lookup(args):
            return original(self, args, *rest, **kw)
        refuse(" ".join(map(str, args)) if isinstance(args, list | tuple) else str(args))

    def forbidden(name: str) -> Any:
        return lambda *args, **kwargs: refuse(f"os.{name}{args[:2]!r}")

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]
    os.fork = forbidden("fork")
    os.posix_spawn, os.posix_spawnp = forbidden("posix_spawn"), forbidden("posix_spawnp")
    try:
        yield attempts
    finally:
        subprocess.Popen._execute_child = original  # type: ignore[attr-defined]
        os.fork, os.posix_spawn, os.posix_spawnp = fork, spawn, spawnp


def _library_lookup(args: Any) -> bool:
    """``ldconfig -p``: how CUDA's Python libraries (triton) find ``libcuda`` on a GPU host,
    inside any test that touches the device; it reads the library cache and starts nothing."""
    argv = list(args) if isinstance(args, list | tuple) else str(args).split()
    return len(argv) == 2 and os.path.basename(str(argv[0])) == "ldconfig" and argv[1] == "-p"


def message(nodeid: str, what: str) -> str:
    """What a test named ``nodeid`` that started ``what`` is told."""
    return (f"{nodeid} started a child process ({what[:200]}) without the `process` marker: "
            "mark it (`pytestmark = pytest.mark.process` in its module, or "
            "`@pytest.mark.process` on the test) so that `make check` leaves it out")
