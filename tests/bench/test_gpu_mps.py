"""bench.gpu.mps: the MPS daemon started and stopped around a run, and what is said when it
cannot be (the control binary faked: no test touches a real GPU's settings)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.gpu import mps
from bench.gpu.mps import Mps, MpsError


class FakeControl:
    """Records each command; answers ``-d`` with ``start_rc``."""

    def __init__(self, start_rc: int = 0) -> None:
        self.start_rc = start_rc
        self.calls: list[tuple[list[str], str | None, dict[str, str]]] = []

    def __call__(self, cmd: list[str], *, env: dict[str, str], input: str | None = None,
                 **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((cmd, input, env))
        if cmd[-1] == "-d":
            return subprocess.CompletedProcess(cmd, self.start_rc, "",
                                               "" if self.start_rc == 0 else "no device\n")
        return subprocess.CompletedProcess(cmd, 0, "4242\n" if input == "get_server_list\n"
                                           else "", "")


def test_the_daemon_starts_with_its_own_pipes_is_exported_and_quits_on_leaving() -> None:
    fake = FakeControl()
    before = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
    with Mps("auto", control="/x/nvidia-cuda-mps-control", run=fake) as m:
        assert m.active and m.status.startswith("on (/x/nvidia-cuda-mps-control")
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert Path(pipe).is_dir() and fake.calls[0][2]["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert m.ask("get_server_list") == "4242"
    assert [c[1] for c in fake.calls] == [None, "get_server_list\n", "quit\n"]
    assert fake.calls[-1][2]["CUDA_MPS_PIPE_DIRECTORY"] == pipe  # quit reaches that daemon
    assert not Path(pipe).exists() and not m.active
    assert {k: os.environ.get(k) for k in before} == before


def test_auto_without_the_binary_runs_without_mps_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setattr(mps.shutil, "which", lambda name: None)
    monkeypatch.setattr(mps, "KNOWN_FOLDERS", (tmp_path,))
    fake = FakeControl()
    with Mps("auto", run=fake) as m:
        assert not m.active and m.status.startswith("not used (missing: no nvidia-cuda-mps")
        assert m.ask("get_server_list") == ""
    assert fake.calls == []
    with pytest.raises(MpsError, match="asked for and is not available: missing"):
        Mps("on", run=fake).__enter__()


def test_a_daemon_that_fails_to_start_is_reported_and_not_used_under_auto() -> None:
    fake = FakeControl(start_rc=1)
    with Mps("auto", control="/x/ctl", run=fake) as m:
        assert not m.active and "exited 1: no device" in m.status
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ or os.environ.get(
            "CUDA_MPS_PIPE_DIRECTORY") != fake.calls[0][2]["CUDA_MPS_PIPE_DIRECTORY"]
    assert len(fake.calls) == 1  # no quit sent to a daemon that never ran
    with pytest.raises(MpsError, match="exited 1"):
        Mps("on", control="/x/ctl", run=FakeControl(start_rc=1)).__enter__()


def test_off_starts_nothing_and_a_bad_mode_is_refused() -> None:
    fake = FakeControl()
    with Mps("off", control="/x/ctl", run=fake) as m:
        assert m.status == "off" and not m.active
    assert fake.calls == []
    with pytest.raises(ValueError, match="one of off, auto, on"):
        Mps("sometimes")


def test_the_control_binary_is_found_in_the_drivers_folder_when_not_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setattr(mps.shutil, "which", lambda name: None)
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert mps.find_control((Path("/nonexistent"), tmp_path)) == str(binary)
    binary.chmod(0o644)
    assert mps.find_control((tmp_path,)) is None
