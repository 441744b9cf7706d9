"""bench.gpu.passes on the CPU (tiny model): one row per pass and mode, each timed and split
into host issue and device wait; a bad --repeats is refused."""

from __future__ import annotations

import json

import pytest

from tests.support.lazy import LazyModule, require

require("torch")
passes = LazyModule("bench.gpu.passes")  # imported by the first test that reads it


def test_each_pass_is_timed_in_each_mode_the_executor_has(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(passes, "SHAPES", (("chunk", 40, 64, 3), ("decode", 0, 0, 2)))
    monkeypatch.setattr(passes, "DECODE_CONTEXT", 100)
    monkeypatch.setattr(passes, "BLOCKS", 64)
    assert passes.main(["--model", "tiny", "--device", "cpu", "--repeats", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    # The CPU has no graphs and no cuDNN: the eager mode alone.
    assert [(r["pass"], r["mode"]) for r in rows] == [("chunk", "eager"), ("decode", "eager")]
    for r in rows:
        assert r["ms"] > 0 and 0 < r["issue_ms"] <= r["ms"] and r["wait_ms"] >= 0


def test_a_repeat_count_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        passes.main(["--model", "tiny", "--device", "cpu", "--repeats", "0"])
    assert "--repeats must be positive" in capsys.readouterr().err
