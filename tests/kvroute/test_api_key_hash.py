"""``kvroute keys hash``: the keys file's line for a client key, read from stdin."""

from __future__ import annotations

import io

import pytest

from httpapi.api_keys import KeyRing, parse_keys
from kvroute.cli import main


def test_hash_reads_the_key_from_stdin_and_prints_a_line_the_router_takes(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-team-a\n"))
    assert main(["keys", "hash", "--name", "team-a", "--tpm", "50000"]) == 0
    out = capsys.readouterr().out
    assert "sk-team-a" not in out
    ring = KeyRing(parse_keys(out))
    entry = ring.identify("sk-team-a")
    assert entry is not None and (entry.name, entry.tokens_per_minute) == ("team-a", 50000)


def test_generate_shows_the_new_key_once_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "hash", "--generate"]) == 0
    captured = capsys.readouterr()
    key = captured.err.split("key (shown once): ", 1)[1].strip()
    assert key not in captured.out
    assert KeyRing(parse_keys(captured.out)).identify(key) is not None


def test_a_bad_name_or_an_empty_key_exits_2(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert main(["keys", "hash"]) == 2
    assert main(["keys", "hash", "--generate", "--name", "a b"]) == 2
    assert "kvroute keys hash:" in capsys.readouterr().err
