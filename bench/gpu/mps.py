"""CUDA MPS for one benchmark run: its control daemon started before the workers and stopped
after them.

Several processes on one GPU without MPS take turns: the device time-slices between their
contexts, so one process's small kernels never run beside another's. Under MPS (the
Multi-Process Service) every client's kernels go through one server context and run
concurrently. :class:`Mps` starts ``nvidia-cuda-mps-control -d`` with its pipe and log folders
in a temporary folder, exports them (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``)
so that the processes started inside the ``with`` block are its clients, and on leaving sends
``quit`` and restores the environment. It changes no GPU setting (compute mode, clocks).

Modes: ``off``; ``auto``, MPS where the control binary is found and starts, otherwise none,
with the reason in :attr:`Mps.status`; ``on``, the same but a missing or failing daemon is an
error (:class:`MpsError`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CONTROL", "MODES", "Mps", "MpsError", "find_control"]

CONTROL = "nvidia-cuda-mps-control"
#: Where the driver's tools sit when they are not on PATH (containers mount them there).
KNOWN_FOLDERS = (Path("/usr/local/nvidia/bin"), Path("/usr/bin"))
MODES = ("off", "auto", "on")
_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


class MpsError(RuntimeError):
    """MPS was required (``on``) and could not be started; the message says why."""


def find_control(folders: tuple[Path, ...] = KNOWN_FOLDERS) -> str | None:
    """The control binary's path: on PATH, else in one of ``folders``; None where missing."""
    found = shutil.which(CONTROL)
    if found:
        return found
    for folder in folders:
        if (folder / CONTROL).is_file() and os.access(folder / CONTROL, os.X_OK):
            return str(folder / CONTROL)
    return None


class Mps:
    """The MPS daemon for the ``with`` block (module docstring).

    Args:
        mode: ``off``, ``auto`` or ``on``.
        control: the control binary (default: :func:`find_control`).
        run: runs a command (``subprocess.run``'s signature; injected by the tests).

    Attributes:
        active: the daemon is running and the environment names it.
        status: one line for the report: ``on (...)``, ``off``, or why not.
    """

    def __init__(self, mode: str, control: str | None = None,
                 run: Callable[..., Any] = subprocess.run) -> None:
        if mode not in MODES:
            raise ValueError(f"MPS mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.control = control
        self._run = run
        self.active = False
        self.status = "off"
        self._saved: dict[str, str | None] = {}
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Mps:
        if self.mode == "off":
            return self
        control = self.control or find_control()
        if control is None:
            return self._unavailable(f"missing: no {CONTROL} on PATH or in "
                                     f"{', '.join(map(str, KNOWN_FOLDERS))}")
        self.control = control
        self._folder = tempfile.TemporaryDirectory(prefix="kvroute-mps-")
        env = {_ENV[0]: f"{self._folder.name}/pipe", _ENV[1]: f"{self._folder.name}/log"}
        for path in env.values():
            Path(path).mkdir()
        try:
            done = self._run([control, "-d"], env=os.environ | env, capture_output=True,
                             text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            return self._unavailable(f"{CONTROL} -d failed: {exc}")
        if done.returncode != 0:
            reason = (done.stderr or done.stdout or "").strip().splitlines()
            return self._unavailable(f"{CONTROL} -d exited {done.returncode}"
                                     + (f": {reason[-1]}" if reason else ""))
        for key, value in env.items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        self.active = True
        self.status = f"on ({control}, pipes in {env[_ENV[0]]})"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            try:
                self.ask("quit")
            finally:
                for key, value in self._saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                self.active = False
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def ask(self, command: str) -> str:
        """Send one command to the control daemon (``get_server_list``, ``quit``); its answer.
        Empty when the daemon is not running."""
        if not self.active or self.control is None:
            return ""
        try:
            done = self._run([self.control], input=command + "\n", env=dict(os.environ),
                             capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"error: {exc}"
        return (done.stdout or "").strip()

    def _unavailable(self, reason: str) -> Mps:
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        if self.mode == "on":
            raise MpsError(f"CUDA MPS was asked for and is not available: {reason}")
        self.status = f"not used ({reason})"
        return self
