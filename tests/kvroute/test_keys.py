"""``kvroute keys generate``: a keypair in ZeroMQ's certificate format, never overwritten."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq.auth

from kvroute.cli import main


def test_generate_writes_a_usable_keypair(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    assert main(["keys", "generate", str(tmp_path / "keys"), "--name", "router"]) == 0
    folder = tmp_path / "keys"
    public_file, secret_file = folder / "router.key", folder / "router.key_secret"
    public, none = zmq.auth.load_certificate(public_file)
    same_public, secret = zmq.auth.load_certificate(secret_file)
    assert none is None and secret is not None and public == same_public
    assert zmq.curve_public(secret) == public
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert str(secret_file) in capsys.readouterr().out


def test_generate_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "generate", str(tmp_path)]) == 0
    before = (tmp_path / "kvroute.key_secret").read_text()
    assert main(["keys", "generate", str(tmp_path)]) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert (tmp_path / "kvroute.key_secret").read_text() == before
    assert main(["keys", "generate", str(tmp_path), "--name", "../escape"]) == 2
