"""Starting a router or worker: admin tokens from a file or the environment, and the refusal to
serve open admin endpoints on a non-loopback address."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from httpapi.auth import is_loopback
from kvroute.cli import main
from router.settings import SettingsError, load_settings
from workers.settings import WorkerSettingsError, load_worker_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVROUTE_ADMIN_TOKEN", "KVROUTE_WORKER_ADMIN_TOKEN", "KVROUTE_HOST",
                 "KVROUTE_WORKER_HOST", "KVROUTE_INSECURE_NO_AUTH",
                 "KVROUTE_WORKER_INSECURE_NO_AUTH"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("command", ["router", "worker"])
def test_a_public_bind_without_a_token_refuses_to_start_and_names_the_risk(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "0.0.0.0" in err and "no admin token" in err and "--insecure-no-auth" in err
    assert "anyone who reaches the port" in err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "router.example"])
def test_every_non_loopback_bind_needs_a_token_or_consent(host: str) -> None:
    with pytest.raises(SettingsError, match="no admin token"):
        load_settings({"host": host}, env={})
    with pytest.raises(WorkerSettingsError, match="no admin token"):
        load_worker_settings({"host": host}, env={})
    assert load_settings({"host": host, "insecure_no_auth": True}, env={}).host == host
    assert load_worker_settings({"host": host}, env={
        "KVROUTE_WORKER_INSECURE_NO_AUTH": "yes"}).insecure_no_auth
    assert load_settings({"host": host}, env={"KVROUTE_ADMIN_TOKEN": "t"}).admin_token == "t"


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("192.168.1.4", False),
    ("myhost", False),
])
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_tokens_are_read_from_files(tmp_path: Path) -> None:
    token, worker_token = tmp_path / "admin", tmp_path / "worker"
    token.write_text("s3cret\n")
    worker_token.write_text("  w0rker  ")
    router = load_settings({"host": "0.0.0.0", "admin_token_file": str(token),
                            "worker_admin_token_file": str(worker_token)}, env={})
    assert (router.admin_token, router.worker_admin_token) == ("s3cret", "w0rker")
    worker = load_worker_settings({"host": "0.0.0.0"}, env={
        "KVROUTE_WORKER_ADMIN_TOKEN_FILE": str(token)})
    assert worker.admin_token == "s3cret"


def test_a_bad_token_file_is_refused_with_its_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SettingsError, match="empty"):
        load_settings({"admin_token_file": str(empty)}, env={})
    with pytest.raises(WorkerSettingsError, match="missing"):
        load_worker_settings({"admin_token_file": str(tmp_path / "missing")}, env={})
    with pytest.raises(SettingsError, match="not both"):
        load_settings({"admin_token_file": str(empty)}, env={"KVROUTE_ADMIN_TOKEN": "t"})


def test_the_cli_takes_the_token_file_and_consent_flags(tmp_path: Path) -> None:
    from kvroute.cli import build_parser

    args = build_parser().parse_args(["router", "--admin-token-file", "/t", "--insecure-no-auth",
                                      "--max-connections", "10", "--header-timeout", "2"])
    assert (args.admin_token_file, args.insecure_no_auth) == ("/t", True)
    assert (args.max_connections, args.header_timeout) == (10, 2.0)
    args = build_parser().parse_args(["worker", "--admin-token-file", "/t"])
    assert args.admin_token_file == "/t" and args.insecure_no_auth is None


def test_compose_takes_every_admin_token_from_the_environment() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        env = service["environment"]
        keys = [k for k in env if k.endswith("ADMIN_TOKEN")]
        assert keys, f"{name} has no admin token"
        for key in keys:
            assert env[key].startswith("${KVROUTE_ADMIN_TOKEN:?"), (name, key)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_event_ports_off_loopback_need_curve_or_consent(host: str, tmp_path: Path) -> None:
    token = {"admin_token": "t"}  # the HTTP side is covered: only the event plane is open
    with pytest.raises(WorkerSettingsError) as info:
        load_worker_settings({"events_host": host, **token}, env={})
    assert str(info.value) == (
        f"the worker would publish KV events on {host} without CURVE: anyone who reaches the "
        "event ports reads the token ids of every cached prompt. Give CURVE keys "
        "(--curve-secret-key, --curve-authorized-clients), bind --events-host 127.0.0.1, or "
        "pass --insecure-events to accept the risk")
    assert load_worker_settings({"events_host": host, "insecure_events": True, **token},
                                env={}).insecure_events
    assert load_worker_settings({"events_host": host, **token}, env={
        "KVROUTE_WORKER_INSECURE_NO_AUTH": "1"}).insecure_no_auth
    # No events published: no event ports open.
    assert load_worker_settings({"events_host": host, "events_port": "none", **token},
                                env={}).events_port is None
    keys = tmp_path / "keys"
    assert main(["keys", "generate", str(keys / "w"), "--name", "w"]) == 0
    assert main(["keys", "generate", str(keys / "r"), "--name", "r"]) == 0
    curve = {"curve_secret_key": str(keys / "w" / "w.key_secret"),
             "curve_authorized_clients": str(keys / "r")}
    assert load_worker_settings({"events_host": host, **curve, **token},
                                env={}).curve_secret_key is not None


def test_a_worker_with_open_event_ports_refuses_to_start_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--events-host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "without CURVE" in err and "--insecure-events" in err
