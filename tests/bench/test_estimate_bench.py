"""bench.estimate's own pieces: a trace's block ids rendered to text keep its prefix sharing,
and its lines are read or refused with the line named."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.estimate import BLOCK_CHARS, TraceText, trace_rows
from bench.workloads import TRACE_BLOCK


def test_equal_block_ids_render_an_equal_prefix_and_lengths_cut_the_text() -> None:
    text = TraceText()
    a = text.prompt(3 * TRACE_BLOCK, [7, 8, 9])
    b = text.prompt(3 * TRACE_BLOCK, [7, 8, 10])
    shared = len(text.prompt(2 * TRACE_BLOCK, [7, 8]))
    assert a[:shared] == b[:shared] and a[shared:] != b[shared:]
    assert len(a) == 3 * BLOCK_CHARS
    cut = text.prompt(TRACE_BLOCK + 5, [7, 8])
    assert len(cut) == (TRACE_BLOCK + 5) * BLOCK_CHARS // TRACE_BLOCK


def test_trace_lines_are_read_in_order_up_to_the_limit_and_a_bad_one_is_named(
        tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_length": 600, "hash_ids": [1, 2]}\n\n'
                     '{"input_length": 10, "hash_ids": [1]}\n{"hash_ids": [3]}\n')
    assert trace_rows(trace, 2) == [(600, [1, 2]), (10, [1])]
    with pytest.raises(ValueError, match=r"trace.jsonl:4: not a Mooncake trace line"):
        trace_rows(trace, 10)
