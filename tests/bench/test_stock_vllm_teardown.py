"""A killed stock vLLM server leaves no shared memory behind: :meth:`VllmServer.kill` removes
the ``/dev/shm`` segments its process group mapped, and only those. The server here is a
stand-in process group that maps a segment as vLLM's message queues do (vLLM itself is not
needed to show the teardown)."""

from __future__ import annotations

import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from bench.stock_vllm import VllmServer

pytestmark = pytest.mark.process  # starts child processes

#: A parent and a child process (as the API server and its engine core); the child maps a
#: named segment, prints its name and waits to be killed.
GROUP = """
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory
def hold():
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    print(segment.name, flush=True)
    time.sleep(120)
if __name__ == "__main__":
    child = mp.get_context("fork").Process(target=hold)
    child.start()
    time.sleep(120)
"""


def test_kill_removes_the_groups_segments_and_leaves_anothers(tmp_path: Path) -> None:
    ours = shared_memory.SharedMemory(create=True, size=1 << 12)  # another server's, say
    try:
        server = VllmServer("stand-in", Path(sys.executable), tmp_path, tmp_path)
        server.popen = subprocess.Popen([sys.executable, "-c", GROUP], stdout=subprocess.PIPE,
                                        start_new_session=True)
        assert server.popen.stdout is not None
        name = server.popen.stdout.readline().decode().strip()
        segment = Path("/dev/shm") / name
        assert name.startswith("psm_") and segment.exists()
        server.kill()
        server.popen.stdout.close()
        assert server.popen.poll() is not None
        assert not segment.exists()
        assert (Path("/dev/shm") / ours.name).exists()
    finally:
        ours.close()
        ours.unlink()
