"""A --tokenizer value: a local path, or a Hugging Face id already in the local cache; anything
else is refused at start in one line that says what to do (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.cli import main
from openai_request.tokenizer import load_tokenizer
from openai_request.tokenizer_source import resolve_tokenizer
from router.settings import RouterSettings, SettingsError
from tests.fixtures.tokenizer_files import write_tiny_tokenizer


def _cache(tmp_path: Path, model: str, revision: str = "abc123") -> Path:
    repo = tmp_path / "hub" / f"models--{model.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    write_tiny_tokenizer(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_a_hub_id_in_the_local_cache_loads_from_it(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _cache(tmp_path, "Org/tiny-model")
    assert resolve_tokenizer("Org/tiny-model") == snapshot
    by_id = load_tokenizer("Org/tiny-model")
    assert by_id.identity == load_tokenizer(str(snapshot)).identity


def test_a_hub_id_not_cached_says_nothing_is_downloaded(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError) as caught:
        resolve_tokenizer("Qwen/Qwen3-8B")
    message = str(caught.value)
    assert "nothing is downloaded at run time" in message and str(tmp_path / "hub") in message
    assert "huggingface-cli download Qwen/Qwen3-8B" in message and "\n" not in message


def test_a_missing_path_is_refused_by_the_settings_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "models" / "llama")
    with pytest.raises(SettingsError, match=f"tokenizer path {missing} does not exist: give "):
        RouterSettings(tokenizer=missing)
    assert main(["router", "--tokenizer", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvroute router: tokenizer path ")
    assert main(["worker", "--tokenizer", missing]) == 2
    assert capsys.readouterr().err.startswith("kvroute worker: tokenizer path ")
