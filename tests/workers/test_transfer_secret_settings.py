"""The KV transfer secret on ``kvroute worker``: read once from its file (flag, the shared
``KVROUTE_KV_TRANSFER_SECRET_FILE`` or ``KVROUTE_WORKER_KV_TRANSFER_SECRET_FILE``), at least
16 bytes, surrounding white space stripped, never shown in the settings' repr; a bad one
stops the start with one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.cli import main
from workers.settings import WorkerSettingsError, load_worker_settings


def test_the_secret_is_read_from_its_file_stripped(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("  sixteen-byte-secret!  \n")
    settings = load_worker_settings({"kv_transfer_secret_file": str(path)}, env={})
    assert settings.kv_transfer_secret == "sixteen-byte-secret!"
    assert "sixteen-byte-secret" not in repr(settings)
    shared = load_worker_settings({}, env={"KVROUTE_KV_TRANSFER_SECRET_FILE": str(path)})
    assert shared.kv_transfer_secret == "sixteen-byte-secret!"
    other = tmp_path / "other"
    other.write_text("the-worker-only-secret")
    # The worker's own variable wins over the shared one, and a flag over both.
    env = {"KVROUTE_KV_TRANSFER_SECRET_FILE": str(path),
           "KVROUTE_WORKER_KV_TRANSFER_SECRET_FILE": str(other)}
    assert load_worker_settings({}, env=env).kv_transfer_secret == "the-worker-only-secret"
    assert load_worker_settings({"kv_transfer_secret_file": str(path)}, env=env
                                ).kv_transfer_secret == "sixteen-byte-secret!"


def test_with_a_secret_a_public_bind_serves_kv(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("sixteen-byte-secret!")
    public = load_worker_settings({"host": "0.0.0.0", "admin_token": "t",
                                   "kv_transfer_secret_file": str(path)}, env={})
    assert public.kv_transfer_open
    assert not load_worker_settings({"host": "0.0.0.0", "admin_token": "t"}, env={}
                                    ).kv_transfer_open
    assert load_worker_settings({}, env={}).kv_transfer_open  # loopback


@pytest.mark.parametrize(("content", "reason"), [
    ("short-secret", "at least 16 bytes"),
    ("   ", "is empty"),
])
def test_a_secret_that_cannot_protect_anything_is_refused(
        tmp_path: Path, content: str, reason: str) -> None:
    path = tmp_path / "secret"
    path.write_text(content)
    with pytest.raises(WorkerSettingsError, match=reason):
        load_worker_settings({"kv_transfer_secret_file": str(path)}, env={})


def test_a_missing_secret_file_stops_the_worker_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent"
    assert main(["worker", "--kv-transfer-secret-file", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kv_transfer_secret_file" in err[0] and str(missing) in err[0]


@pytest.mark.parametrize(("flags", "name"), [
    ({"kv_fetch_timeout": 0}, "kv_fetch_timeout"),
    ({"kv_fetch_concurrency": 0}, "kv_fetch_concurrency"),
    ({"kv_read_concurrency": -1}, "kv_read_concurrency"),
])
def test_fetch_bounds_must_be_positive(flags: dict[str, float], name: str) -> None:
    with pytest.raises(WorkerSettingsError, match=name):
        load_worker_settings(flags, env={})
