"""The free-port spans of a test session and of its pytest-xdist runners.

:func:`kvroute.up.free_port` never hands a port out twice in one process and checks that it is
free when it picks it, but a child process binds it a second or two later. Two suites running
on one machine at once (two checkouts) that drew from one span could each pick a port the
other's child is about to bind: a worker of one then fails to bind its event or replay port.
So each session takes a slot of its own, a share of the span held by an exclusive ``flock`` on
a file per slot for the session's life (the kernel drops the lock when the process ends, so a
killed session frees its slot), and its runners divide that share. When every slot is held,
the session draws from the whole span, as every session did before slots.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import IO

__all__ = ["SLOTS", "runner_span", "session_span"]

#: Sessions on one machine that get spans of their own.
SLOTS = 5


def session_span(span: tuple[int, int], lock_dir: Path, slots: int = SLOTS
                 ) -> tuple[tuple[int, int], IO[str] | None]:
    """The share of ``span`` this session takes, and the open lock file that holds it (keep
    it open for the session's life; None when every slot was taken and the whole span is
    returned)."""
    width = (span[1] - span[0]) // slots
    for slot in range(slots):
        handle = (lock_dir / f"kvroute-test-ports-{slot}.lock").open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        with contextlib.suppress(OSError):
            os.chmod(handle.name, 0o666)  # another user's session may take it next
        low = span[0] + slot * width
        return (low, low + width), handle
    return span, None


def runner_span(span: tuple[int, int], index: int, count: int) -> tuple[int, int]:
    """Runner ``index``'s share of the session's ``span`` among ``count`` runners."""
    count = max(count, index + 1)
    width = (span[1] - span[0]) // count
    low = span[0] + index * width
    return low, low + width
