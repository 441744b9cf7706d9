"""The docs' quick figures match what bench.docs_figures computes now, and its check sees a
figure that drifted, a marker it does not know and a figure no doc shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.docs_figures import FIGURES, check, main, marked, write


@pytest.fixture(scope="module")
def computed() -> None:
    """Every figure computed once for the module (about 12 CPU seconds: the trace's bounds at
    four cluster sizes, kept by bench.docs_figures for the process); its tests run on one
    pytest-xdist runner (conftest.py), so they share it."""
    for figure in FIGURES:
        figure.compute()


@pytest.mark.timeout(600)
def test_every_quick_figure_in_the_docs_is_true_now(computed: None) -> None:
    assert check() == []


def test_the_check_names_a_drifted_figure_an_unknown_marker_and_an_unshown_one(
        tmp_path: Path) -> None:
    shown = [f.name for f in FIGURES if f.name != "trace_unlimited"]
    lines = [f"{name}: {next(f for f in FIGURES if f.name == name).compute()}<!-- fig:{name} -->"
             for name in shown if name.startswith("measured")]
    doc = tmp_path / "a.md"
    doc.write_text("\n".join([*lines, "old 1.0%<!-- fig:calibrated_decode_ns -->",
                              "x 3<!-- fig:no_such -->"]) + "\n")
    problems = check(tmp_path)
    assert any("fig:calibrated_decode_ns says 1.0%" in p and "prints 80.3" in p
               for p in problems), problems
    assert any("fig:no_such is no figure" in p for p in problems)
    assert "fig:trace_unlimited is marked in no doc" in problems
    assert not any("measured" in p for p in problems)
    assert write(tmp_path) == 1
    assert ("calibrated_decode_ns", "80.3") in [(n, v) for _, n, v in marked(tmp_path)]


@pytest.mark.timeout(600)
def test_the_command_prints_every_figure(computed: None, capsys: object) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert [line.split(":")[0] for line in out.splitlines()] == [f.name for f in FIGURES]
