"""The ``process`` marker is kept honest: while a test without it runs, every way of starting
a child process is refused and remembered (:mod:`tests.support.child_processes`), and the
top-level ``conftest.py`` fails such a test naming the command."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys

import pytest

from tests.support.child_processes import UnmarkedProcess, no_child_processes


def test_every_way_of_starting_a_process_is_refused_and_remembered() -> None:
    popen = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    with no_child_processes("t::x") as attempts:
        with pytest.raises(UnmarkedProcess, match=r"t::x started a child process \(/bin/true"):
            subprocess.run(["/bin/true", "--flag"], check=False)
        with pytest.raises(UnmarkedProcess):
            os.fork()
        with pytest.raises(UnmarkedProcess):
            os.posix_spawn("/bin/true", ["/bin/true"], {})

        async def spawn() -> None:
            await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        with pytest.raises(UnmarkedProcess):
            asyncio.run(spawn())
        with pytest.raises(UnmarkedProcess, match="mark it"), contextlib.suppress(OSError):
            subprocess.check_output("echo hi", shell=True)  # an OSError would be swallowed
    assert len(attempts) == 5
    assert subprocess.Popen._execute_child is popen  # type: ignore[attr-defined]


def test_a_refusal_swallowed_by_the_code_under_test_is_still_remembered() -> None:
    # The suppress stands for careless code under test.
    with no_child_processes("t::y") as attempts, contextlib.suppress(Exception):
        subprocess.run(["/bin/true"], check=False)
    assert attempts == ["/bin/true"]




@pytest.mark.gpu
def test_a_gpu_test_counts_as_starting_processes(request: pytest.FixtureRequest) -> None:
    # Marked gpu to be checked, though it needs no device: on a GPU host Triton compiles each
    # kernel's launcher with the host's C compiler, so every gpu-marked test starts
    # processes, and make check must leave them out.
    assert request.node.get_closest_marker("process") is not None
