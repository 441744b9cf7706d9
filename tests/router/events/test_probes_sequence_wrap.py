"""Probes of the stream sequencer at the ends of the sequence space: seqs near 2**63 (the
wire's limit, :data:`indexer.wire.SEQ_LIMIT`) and 2**64 (the frame's), a stream that wraps
to 0, replay answers out of range. For every probe: no exception, delivered seqs strictly
ascending and below the limit, no replay asked from a seq at or past the limit, nothing held
without bound."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from indexer.wire import REPLAY_END_SEQ, SEQ_LIMIT, pack_seq
from router.events.sequencer import (
    Delivered,
    MalformedInput,
    ReplayRequest,
    Restarted,
    StreamSequencer,
)
from tests.router.events.test_sequencer import live, payload, replayed

TOP = SEQ_LIMIT - 1
END = [b"", b"", REPLAY_END_SEQ, b""]


def raw_live(seq_frame: bytes, seq_for_payload: int = 0) -> list[bytes]:
    return [b"", seq_frame, payload(seq_for_payload)]


def run(steps: list[tuple[str, Any]]) -> tuple[StreamSequencer, list[Any]]:
    s = StreamSequencer(replay=True, probe_interval=1.0)
    out: list[Any] = list(s.begin(0.0))
    now = 0.0
    for kind, value in steps:
        now += 0.5
        if kind == "live":
            out += s.live(value, now)
        elif kind == "replayed":
            out += s.replayed(value, now)
        else:
            out += s.tick(now + value)
    return s, out


def check(s: StreamSequencer, out: list[Any]) -> None:
    delivered = [a.seq for a in out if isinstance(a, Delivered)]
    # ascending between restarts
    runs: list[list[int]] = [[]]
    for a in out:
        if isinstance(a, Restarted):
            runs.append([])
        elif isinstance(a, Delivered):
            runs[-1].append(a.seq)
    for r in runs:
        assert r == sorted(set(r)), r
    assert all(0 <= q < SEQ_LIMIT for q in delivered)
    assert all(0 <= a.start < SEQ_LIMIT for a in out if isinstance(a, ReplayRequest)), out
    assert s.last_seq is None or 0 <= s.last_seq < SEQ_LIMIT
    assert len(s._held) <= 4


PROBES: dict[str, Callable[[], list[tuple[str, Any]]]] = {
    "the last seq, then quiet (a probe)": lambda: [
        ("live", live(TOP - 1)), ("live", live(TOP)), ("tick", 5.0)],
    "the last seq, then the limit": lambda: [
        ("live", live(TOP)), ("live", raw_live(pack_seq(SEQ_LIMIT)))],
    "the last seq, then 2**64 - 1": lambda: [
        ("live", live(TOP)), ("live", raw_live(b"\xff" * 8))],
    "the last seq, then wraps to 0": lambda: [
        ("live", live(TOP)), ("live", live(0)), ("live", live(1))],
    "starts at the last seq": lambda: [("live", live(TOP)), ("tick", 5.0)],
    "a gap to the last seq": lambda: [("live", live(0)), ("live", live(TOP))],
    "a gap to the last seq, replay answers past it": lambda: [
        ("live", live(0)), ("live", live(TOP)), ("replayed", [b"", b"", pack_seq(SEQ_LIMIT),
                                                             payload(1)]),
        ("replayed", END)],
    "a replay answering 2**64 - 2": lambda: [
        ("live", live(0)), ("live", live(5)),
        ("replayed", [b"", b"", b"\xff" * 7 + b"\xfe", payload(1)]), ("replayed", END)],
    "a seq frame of 7 bytes": lambda: [("live", raw_live(b"\x00" * 7))],
    "a seq frame of 9 bytes": lambda: [("live", raw_live(b"\x00" * 9))],
    "the replay end marker live": lambda: [("live", raw_live(REPLAY_END_SEQ))],
    "many strays far ahead during a replay": lambda: [
        ("live", live(0)), ("live", live(10)),
        *[("live", live(TOP - i)) for i in range(50)], ("live", live(1))],
    "replayed beyond the limit then the end": lambda: [
        ("live", live(3)), ("live", live(9)),
        ("replayed", replayed(4)), ("replayed", [b"", b"", b"\x80" + b"\x00" * 7, b""]),
        ("replayed", END)],
}


@pytest.mark.parametrize("steps", PROBES.values(), ids=PROBES.keys())
def test_sequence_space_probe(steps: Callable[[], list[tuple[str, Any]]]) -> None:
    s, out = run(steps())
    check(s, out)


def test_a_seq_at_the_limit_is_counted_malformed() -> None:
    s, out = run([("live", live(1)), ("live", raw_live(pack_seq(SEQ_LIMIT)))])
    assert any(isinstance(a, MalformedInput) for a in out)
    assert s.last_seq == 1
