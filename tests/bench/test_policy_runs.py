"""docs/benchmarks.md's generated-workloads table is what bench.policy_runs computes from the
runs behind it, and the check names a row that drifted."""

from __future__ import annotations

from pathlib import Path

from bench.policy_runs import DOC, SECTION, check, main


def test_the_results_table_matches_the_runs() -> None:
    assert check() == []


def test_the_check_names_a_drifted_row_and_a_missing_one(tmp_path: Path) -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text.split(f"\n{SECTION}\n", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| `images` "))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(text.replace(row, row.replace(" | 16 | ", " | 15 | ", 1), 1)
                   .replace("| `agentic` | 4 x 2M | x1.5 |", "| `agentic` | 4 x 2M | x1.6 |")
                   .replace("\n| `agentic` | 4 x 2M | x1 |", "\n<!-- gone -->", 1),
                   encoding="utf-8")
    problems = check(doc)
    assert any("| 15 |" in p and row in p for p in problems), problems
    assert any("has 23 rows" in p and "prints 24" in p for p in problems), problems


def test_the_command_prints_the_table_the_misses_and_the_tally(capsys: object) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert out.count("\n| `") == 23 and out.startswith("| `system_prompt` ")
    assert "multi_turn 4 x 0.5M x6 seed 6: kvroute misses TTFT p50" in out
    assert "targets over 252 runs: kvroute meets every target in 236;" in out
