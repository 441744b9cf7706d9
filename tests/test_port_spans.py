"""Sessions on one machine draw free ports from spans of their own, and their runners divide a
session's span (:mod:`tests.support.port_spans`)."""

from __future__ import annotations

from pathlib import Path

from tests.support.port_spans import runner_span, session_span

SPAN = (20000, 32500)


def test_a_second_session_takes_the_next_slot_while_the_first_holds_its_own(
        tmp_path: Path) -> None:
    first, held = session_span(SPAN, tmp_path, slots=5)
    second, also_held = session_span(SPAN, tmp_path, slots=5)
    assert held is not None and also_held is not None
    assert first == (20000, 22500) and second == (22500, 25000)
    held.close()  # the first holder let go: its slot is free again
    third, third_held = session_span(SPAN, tmp_path, slots=5)
    assert third == first
    for handle in (also_held, third_held):
        assert handle is not None
        handle.close()


def test_when_every_slot_is_held_a_session_shares_the_whole_span(tmp_path: Path) -> None:
    handles = [session_span(SPAN, tmp_path, slots=2)[1] for _ in range(2)]
    span, held = session_span(SPAN, tmp_path, slots=2)
    assert (span, held) == (SPAN, None)
    for handle in handles:
        assert handle is not None
        handle.close()


def test_runners_divide_the_sessions_span_without_overlap() -> None:
    spans = [runner_span((20000, 22500), i, 2) for i in range(2)]
    assert spans == [(20000, 21250), (21250, 22500)]
    assert runner_span((20000, 22500), 2, 2) == (20000 + 2 * 833, 20000 + 3 * 833)
