"""The stream sequencer alone: frames and timestamps in, notices and replay requests out."""

from __future__ import annotations

from typing import Any

import pytest

from indexer.wire import REPLAY_END_SEQ, BlockRemoved, KVEventBatch, encode_batch, pack_seq
from router.events.sequencer import (
    Delivered,
    GapDetected,
    HistoryLost,
    MalformedInput,
    ReplayRequest,
    Restarted,
    StreamSequencer,
)


def payload(i: int) -> bytes:
    return encode_batch(KVEventBatch(float(i), [BlockRemoved(block_hashes=[i], medium="GPU",
                                                             group_idx=0)], 0))


def live(seq: int) -> list[bytes]:
    return [b"", pack_seq(seq), payload(seq)]


def replayed(seq: int) -> list[bytes]:
    return [b"", b"", pack_seq(seq), payload(seq)]


END = [b"", b"", REPLAY_END_SEQ, b""]


def summary(actions: list[Any]) -> list[Any]:
    """Actions with each Delivered shortened to ("delivered", seq, replayed)."""
    return [("delivered", a.seq, a.replayed) if isinstance(a, Delivered) else a
            for a in actions]


def test_in_order_live_batches_are_delivered() -> None:
    s = StreamSequencer(replay=True, probe_interval=None)
    assert s.begin(0.0) == []
    out = [a for seq in range(3) for a in s.live(live(seq), 0.1)]
    assert summary(out) == [("delivered", 0, False), ("delivered", 1, False),
                            ("delivered", 2, False)]
    assert s.last_seq == 2 and s.deadline is None


def test_catch_up_replays_from_the_seq_asked_for() -> None:
    s = StreamSequencer(replay=True, probe_interval=None)
    assert s.begin(0.0, from_seq=0) == [ReplayRequest(0)]
    assert s.live(live(2), 0.1) == []  # held while the replay is in flight
    assert summary(s.replayed(replayed(0), 0.1) + s.replayed(replayed(1), 0.1)) == [
        ("delivered", 0, True), ("delivered", 1, True)]
    assert summary(s.replayed(END, 0.2)) == [("delivered", 2, False)]


def test_a_gap_is_filled_by_replay_and_held_batches_follow() -> None:
    s = StreamSequencer(replay=True, probe_interval=None)
    s.begin(0.0)
    s.live(live(0), 0.0)
    # seq 1 and 2 were dropped at the socket; 3 shows the gap
    assert s.live(live(3), 1.0) == [GapDetected(1, 3), ReplayRequest(1)]
    assert s.live(live(4), 1.0) == []
    out = s.replayed(replayed(1), 1.1) + s.replayed(replayed(2), 1.1)
    out += s.replayed(replayed(3), 1.1)  # also held: a duplicate of it is dropped later
    out += s.replayed(END, 1.1)
    assert summary(out) == [("delivered", 1, True), ("delivered", 2, True),
                            ("delivered", 3, True), ("delivered", 4, False)]
    assert s.stats.duplicates == 1 and s.stats.history_lost == 0


def test_a_replay_that_starts_above_the_gap_is_history_lost() -> None:
    s = StreamSequencer(replay=True, probe_interval=None)
    s.begin(0.0)
    s.live(live(0), 0.0)
    s.live(live(9), 0.0)
    out = s.replayed(replayed(7), 0.1)
    assert summary(out) == [HistoryLost(1, 7, "replay buffer no longer holds it"),
                            ("delivered", 7, True)]


def test_a_replay_that_never_covers_the_gap_backs_off_then_gives_up() -> None:
    # The replay socket answers only its end marker while the live seq has jumped: each
    # replay ends with the gap still open. Replays are asked again after 0.05, 0.1, 0.2 s
    # (doubling), four in all, then the gap is history lost and the held batch applied.
    s = StreamSequencer(replay=True, probe_interval=None, retry_delay=0.05,
                        max_retry_delay=1.0, max_replay_attempts=4)
    s.begin(0.0)
    s.live(live(0), 0.0)
    assert s.live(live(5), 0.0) == [GapDetected(1, 5), ReplayRequest(1)]
    assert s.replayed(END, 0.0) == []
    assert s.deadline == pytest.approx(0.05)
    assert s.tick(0.04) == []  # not yet
    assert s.live(live(6), 0.04) == []  # held too
    assert s.tick(0.05) == [ReplayRequest(1)]
    assert s.replayed(END, 0.05) == []
    assert s.deadline == pytest.approx(0.15)
    assert s.tick(s.deadline) == [ReplayRequest(1)]
    assert s.replayed(END, 0.15) == []
    assert s.deadline == pytest.approx(0.35)
    assert s.tick(s.deadline) == [ReplayRequest(1)]
    out = s.replayed(END, 0.35)
    assert summary(out) == [HistoryLost(1, 5, "replay did not cover the gap"),
                            ("delivered", 5, False), ("delivered", 6, False)]
    assert s.stats.replays == 4 and s.stats.replay_retries == 3 and s.stats.gaps == 1
    assert s.deadline is None
    assert summary(s.live(live(7), 0.4)) == [("delivered", 7, False)]


def test_the_retry_delay_is_capped() -> None:
    s = StreamSequencer(replay=True, probe_interval=None, retry_delay=1.0,
                        max_retry_delay=2.0, max_replay_attempts=10)
    s.begin(0.0)
    s.live(live(0), 0.0)
    s.live(live(5), 0.0)
    now, delays = 0.0, []
    for _ in range(4):
        s.replayed(END, now)
        assert s.deadline is not None
        delays.append(s.deadline - now)
        now = s.deadline
        assert s.tick(now) == [ReplayRequest(1)]
    assert delays == [1.0, 2.0, 2.0, 2.0]


def test_a_replay_that_makes_progress_is_asked_again_at_once() -> None:
    s = StreamSequencer(replay=True, probe_interval=None)
    s.begin(0.0)
    s.live(live(0), 0.0)
    s.live(live(5), 0.0)
    s.replayed(replayed(1), 0.1)
    s.replayed(replayed(2), 0.1)
    # 3 and 4 are missing from this answer (lost after the replay's snapshot): a new gap
    assert summary(s.replayed(END, 0.1)) == [GapDetected(3, 5), ReplayRequest(3)]


def test_an_unanswered_gap_replay_times_out_as_history_lost() -> None:
    s = StreamSequencer(replay=True, replay_timeout=2.0, probe_interval=None)
    s.begin(0.0)
    s.live(live(0), 0.0)
    s.live(live(4), 0.0)
    assert s.deadline == 2.0
    assert s.tick(1.9) == []
    assert summary(s.tick(2.0)) == [HistoryLost(1, 4, "replay timed out"),
                                    ("delivered", 4, False)]


def test_a_quiet_stream_is_probed_and_an_unanswered_probe_is_not_loss() -> None:
    s = StreamSequencer(replay=True, replay_timeout=0.5, probe_interval=1.0)
    s.begin(0.0)
    s.live(live(0), 0.0)
    assert s.deadline == 1.0
    assert s.tick(1.0) == [ReplayRequest(1)]
    assert s.tick(1.5) == []  # timed out, counted, nothing reported
    assert s.stats.probes == 1 and s.stats.probe_timeouts == 1 and s.stats.replays == 0
    assert s.deadline == 2.5


def test_a_live_batch_that_continues_the_stream_ends_a_probe() -> None:
    s = StreamSequencer(replay=True, replay_timeout=30.0, probe_interval=1.0)
    s.begin(0.0)
    s.live(live(0), 0.0)
    s.tick(1.0)
    assert summary(s.live(live(1), 1.1)) == [("delivered", 1, False)]
    assert s.replayed(END, 1.2) == []  # the probe's late answer is ignored


def test_a_seq_that_goes_backwards_is_a_restart() -> None:
    s = StreamSequencer(replay=True, probe_interval=None)
    s.begin(0.0)
    for seq in range(3):
        s.live(live(seq), 0.0)
    assert summary(s.live(live(0), 0.1)) == [Restarted(2, 0), ("delivered", 0, False)]
    # a new instance first seen past its seq 0 is replayed from 0
    assert s.live(live(4), 0.2) == [GapDetected(1, 4), ReplayRequest(1)]
    s.replayed(END, 0.2)
    s2 = StreamSequencer(replay=True, probe_interval=None)
    s2.begin(0.0)
    for seq in range(5):
        s2.live(live(seq), 0.0)
    assert s2.live(live(2), 0.1) == [Restarted(4, 2), GapDetected(0, 2), ReplayRequest(0)]
    assert s.stats.restarts == 1 and s2.stats.restarts == 1


def test_without_a_replay_endpoint_a_gap_is_history_lost_at_once() -> None:
    s = StreamSequencer(replay=False)
    s.begin(0.0)
    s.live(live(0), 0.0)
    assert summary(s.live(live(3), 0.0)) == [GapDetected(1, 3),
                                             HistoryLost(1, 3, "no replay endpoint"),
                                             ("delivered", 3, False)]
    assert s.deadline is None


def test_malformed_frames_are_reported_and_skipped() -> None:
    s = StreamSequencer(replay=True, probe_interval=None)
    s.begin(0.0, from_seq=0)
    assert s.live([b"one"], 0.0) == [MalformedInput(None, "live message of 1 frames")]
    assert s.replayed([b"x", b"", b""], 0.0) == [MalformedInput(None,
                                                                "replay reply of 3 frames")]
    assert s.replayed([b"", b"", b"short", b""], 0.0)[0].reason == "replay reply of 4 frames"
    (bad,) = s.replayed([b"", b"", pack_seq(0), b"\xc1"], 0.0)
    assert isinstance(bad, MalformedInput) and bad.seq == 0
    assert s.last_seq == 0, "a malformed batch still uses up its seq"
    assert s.stats.malformed == 4


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        StreamSequencer(replay=True, max_replay_attempts=0)
    with pytest.raises(ValueError):
        StreamSequencer(replay=True, retry_delay=1.0, max_retry_delay=0.5)


# -- input at the edges: seqs out of range, bursts of bad frames, stray batches ------------

TOP = b"\xff" * 8  # 2**64 - 1: also the replay end marker
HALF = (2**63).to_bytes(8, "big")


def test_a_live_seq_out_of_range_is_malformed_and_moves_nothing() -> None:
    s = StreamSequencer(replay=True, replay_timeout=0.5, probe_interval=1.0)
    s.begin(0.0)
    # First thing on the stream: not taken as its start.
    assert s.live([b"", TOP, payload(1)], 0.0) == [
        MalformedInput(2**64 - 1, f"seq {2**64 - 1} is out of range (at most {2**63 - 1})")]
    assert s.last_seq is None and s.deadline is None
    s.live(live(0), 0.0)
    assert s.live([b"", HALF, payload(1)], 0.5) == [
        MalformedInput(2**63, f"seq {2**63} is out of range (at most {2**63 - 1})")]
    # The position and the quiet clock are untouched: the probe asks for seq 1 on time.
    assert (s.last_seq, s.deadline) == (0, 1.0)
    assert s.tick(1.0) == [ReplayRequest(1)]
    assert summary(s.live(live(1), 1.1)) == [("delivered", 1, False)]
    assert s.stats.malformed == 2 and s.stats.restarts == 0 and s.stats.gaps == 0


def test_the_largest_seq_asks_for_no_replay_past_it() -> None:
    # Nothing but a restart's batch can follow the wire's last seq: a probe would ask for a
    # seq the wire does not allow.
    s = StreamSequencer(replay=True, replay_timeout=0.5, probe_interval=1.0)
    s.begin(0.0)
    top = 2**63 - 1
    assert summary(s.live([b"", pack_seq(top), payload(0)], 0.0)) == [("delivered", top, False)]
    assert s.tick(1.0) == [] and s.tick(5.0) == []
    assert summary(s.live([b"", pack_seq(0), payload(0)], 6.0)) == [
        Restarted(top, 0), ("delivered", 0, False)]


def test_a_replayed_seq_out_of_range_is_malformed() -> None:
    s = StreamSequencer(replay=True, probe_interval=None)
    s.begin(0.0, from_seq=0)
    assert s.replayed([b"", b"", HALF, payload(0)], 0.0) == [
        MalformedInput(2**63, f"seq {2**63} is out of range (at most {2**63 - 1})")]
    assert summary(s.replayed(replayed(0), 0.0)) == [("delivered", 0, True)]


def test_pack_seq_refuses_what_no_frame_can_carry() -> None:
    assert pack_seq(2**64 - 2) == b"\xff" * 7 + b"\xfe"
    for seq in (-1, 2**64 - 1, 2**64):
        with pytest.raises(ValueError, match=r"^seq .* is out of range for a seq frame$"):
            pack_seq(seq)


def test_a_burst_of_malformed_frames_leaves_the_stream_where_it_was() -> None:
    # Seqs 0-3 delivered; then frames that are odd (wrong frame count, 7-byte seq, the end
    # marker as a live seq) or whose payload does not decode, at the next seq, further on
    # and behind. A frame is ordered by its seq only once its payload decodes, so none of
    # them moves the position: seq 4 and 5 that follow apply at once, with no gap, no replay
    # and no restart (which would clear the worker).
    s = StreamSequencer(replay=True, probe_interval=1.0)
    s.begin(0.0)
    for seq in range(4):
        s.live(live(seq), 0.0)
    burst = [
        [b"x"],
        [b"", pack_seq(4)],
        [b"", b"\x00" * 7, payload(4)],
        [b"", pack_seq(4), b"\xc1\xc1"],
        [b"", pack_seq(5), payload(5)[:-3]],
        [b"", pack_seq(1000), b"\x93"],
        [b"", TOP, payload(4)],
        [b"", pack_seq(1), b"junk"],
    ]
    out = [a for frames in burst for a in s.live(frames, 0.5)]
    assert [type(a) for a in out] == [MalformedInput] * len(burst)
    assert s.last_seq == 3 and s.deadline == 1.0
    assert summary(s.live(live(4), 0.6) + s.live(live(5), 0.6)) == [
        ("delivered", 4, False), ("delivered", 5, False)]
    assert (s.stats.malformed, s.stats.gaps, s.stats.restarts, s.stats.history_lost) == (
        len(burst), 0, 0, 0)


def test_a_batch_that_continues_the_stream_is_delivered_during_a_gap_replay() -> None:
    # A well-formed batch far ahead (a stray, or a publisher that skipped) opens a gap. The
    # live stream is ordered, so a batch that continues from the last seq after it proves
    # the stray was not part of the stream: it is dropped as malformed, the replay ended,
    # and the stream goes on at once; nothing counts as lost.
    s = StreamSequencer(replay=True, replay_timeout=30.0, probe_interval=None)
    s.begin(0.0)
    for seq in range(4):
        s.live(live(seq), 0.0)
    assert s.live(live(1000), 0.1) == [GapDetected(4, 1000), ReplayRequest(4)]
    assert summary(s.live(live(4), 0.2)) == [
        MalformedInput(1000, "batch ahead of the live stream, out of order"),
        ("delivered", 4, False)]
    assert s.deadline is None, "no replay left in flight"
    assert s.replayed(replayed(4), 0.3) + s.replayed(END, 0.3) == []  # the late answer
    assert summary(s.live(live(5), 0.4)) == [("delivered", 5, False)]
    assert s.stats.history_lost == 0 and s.stats.restarts == 0
