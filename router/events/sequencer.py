"""The ordering and replay rules of one engine rank's event stream, without sockets or clocks.

:class:`StreamSequencer` takes what the sockets received (live frames, replay frames) and the
time, and returns actions: :data:`Notice` values for the consumer and :class:`ReplayRequest`
values for the replay socket. :class:`router.events.subscriber.EventSubscriber` is the socket shell
around it; tests drive it directly with frames and timestamps.

The notices, handed to the consumer in order:

- ``Delivered``: a batch, decoded; every seq exactly once, ascending, live or replayed.
- ``GapDetected``: a live seq jumped; a replay from the last seq + 1 is asked for. Live batches
  arriving meanwhile are held back and merged after the replay; duplicates are dropped.
- ``HistoryLost``: replay could not cover a gap (its first batch was above the seq asked for,
  it timed out, it kept answering without the missing batches, or there is no replay
  endpoint), or a catch-up replay asked for at start timed out. The consumer must
  resynchronise that worker.
- ``Restarted``: the seq went backwards outside a replay: a new engine instance. The consumer
  clears what it knew; the sequencer then expects seq 0 again.
- ``MalformedInput``: a frame or payload that could not be used; counted and skipped.

Notes:
    1. Loss at the end of a burst shows no gap until the next batch arrives, which may be long
       on an idle engine. So when the live stream has been quiet for ``probe_interval``
       seconds, the sequencer asks for a replay from its last seq + 1 (a probe): an empty
       answer costs one round trip, and batches the socket dropped arrive as a normal replay.
       A probe that goes unanswered is counted, not reported: nothing is known lost, and a
       ``HistoryLost`` would have the router drop that worker's index at every quiet spell.
       A live batch that continues the stream ends a probe at once, since it proves nothing
       was lost before it. After the last seq the wire allows (``SEQ_LIMIT - 1``) nothing
       is probed: no batch can follow it but a restart's.
    2. A replay that ends without the batches a gap needs and without delivering anything
       (a replay buffer that answers only its end marker) is asked again after a delay that
       doubles from ``retry_delay`` up to ``max_retry_delay``, at most ``max_replay_attempts``
       times for one gap; then the gap is history lost and the held batches are delivered.
       Without this a misbehaving replay socket turns the subscriber into a busy loop that
       holds the live batch forever.
    3. Never raises on input: bad frames are ``MalformedInput``.
    4. A live message is ordered by its seq only once its payload decodes and its seq is below
       :data:`~indexer.wire.SEQ_LIMIT`: until then nothing says the publisher sent it, so a
       bad one moves nothing (not the position, not the quiet clock) and cannot open a gap
       or pass for a restart. Had the publisher sent it, the next batch shows a gap and
       replay recovers it (without replay, that is history lost: its events are lost).
       A replayed batch whose payload does not decode still uses up its seq: the replay
       buffer is the publisher's own record.
    5. The live stream is ordered (one connection). So a live batch that continues from the
       last seq is delivered at once, even during a replay or its retry delay; batches held
       above it arrived before it and cannot be part of the stream: they are dropped as
       malformed and the gap they opened is closed. A stray batch far ahead therefore costs
       one replay request, not a stall, and nothing counts as lost.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

from indexer.decode import DecodeStats, MalformedBatch, decode_batch
from indexer.events import Batch
from indexer.wire import REPLAY_END_SEQ, SEQ_LIMIT, unpack_seq

__all__ = [
    "Action",
    "Delivered",
    "GapDetected",
    "HistoryLost",
    "MalformedInput",
    "Notice",
    "ReplayRequest",
    "Restarted",
    "StreamSequencer",
    "SubscriberStats",
]


class Delivered(NamedTuple):
    seq: int
    batch: Batch
    replayed: bool


class GapDetected(NamedTuple):
    expected: int
    received: int


class HistoryLost(NamedTuple):
    first_missing: int
    resumed_at: int | None
    reason: str


class Restarted(NamedTuple):
    last_seq: int
    seq: int


class MalformedInput(NamedTuple):
    seq: int | None
    reason: str


class ReplayRequest(NamedTuple):
    """Send ``[b"", start]`` on the replay socket."""

    start: int


Notice = Delivered | GapDetected | HistoryLost | Restarted | MalformedInput
Action = Notice | ReplayRequest


@dataclass(slots=True)
class SubscriberStats:
    """Counters of one subscription (the socket shell adds its own to the same object)."""

    callback_errors: int = 0
    delivered: int = 0
    duplicates: int = 0
    gaps: int = 0
    handshake_failures: int = 0
    history_lost: int = 0
    malformed: int = 0
    oversize: int = 0
    probe_timeouts: int = 0
    probes: int = 0
    replay_retries: int = 0
    replayed: int = 0
    replays: int = 0
    restarts: int = 0

    def as_dict(self) -> dict[str, int]:
        """Return the counters by name."""
        return asdict(self)


class StreamSequencer:
    """Orders one rank's batches by seq and decides when to ask for replays.

    Args:
        replay: whether the engine has a replay endpoint.
        replay_timeout: seconds to wait for a replay's end marker before giving up on it.
        probe_interval: quiet seconds after which a probe checks for trailing loss; ``None``
            disables probing.
        retry_delay: delay before the second replay of a gap the first did not cover.
        max_retry_delay: the longest delay between replays of one gap.
        max_replay_attempts: replays of one gap, at most, before it counts as history lost.
    """

    def __init__(self, *, replay: bool, replay_timeout: float = 2.0,
                 probe_interval: float | None = 1.0, retry_delay: float = 0.05,
                 max_retry_delay: float = 2.0, max_replay_attempts: int = 6) -> None:
        if max_replay_attempts < 1:
            raise ValueError("max_replay_attempts must be at least 1")
        if retry_delay <= 0 or max_retry_delay < retry_delay:
            raise ValueError("retry delays must be positive, the maximum at least the first")
        self._has_replay = replay
        self._replay_timeout = replay_timeout
        self._probe_interval = probe_interval
        self._retry_delay = retry_delay
        self._max_retry_delay = max_retry_delay
        self._max_attempts = max_replay_attempts
        self._last: int | None = None
        self._quiet_since = 0.0
        self._replay_from: int | None = None  # seq asked for, while a replay is in flight
        self._probing = False  # the replay in flight is a probe
        self._replay_deadline = 0.0
        self._retry_at: float | None = None  # a replay of the gap is due then
        self._retry_from = 0
        self._attempts = 0  # replays of the current gap
        self._progress = False  # a batch was delivered since the last replay request
        self._held: dict[int, Batch] = {}  # live batches held back during a replay
        self._out: list[Action] = []
        self.stats = SubscriberStats()
        self.decode_stats = DecodeStats()

    @property
    def last_seq(self) -> int | None:
        """The last seq delivered, or ``None`` before the first."""
        return self._last

    @property
    def deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (a timeout, a retry, a probe)."""
        if self._replay_from is not None:
            return self._replay_deadline
        if self._retry_at is not None:
            return self._retry_at
        if not self._has_replay or self._probe_interval is None or self._last is None:
            return None
        return self._quiet_since + self._probe_interval

    # -- inputs -----------------------------------------------------------------------------

    def begin(self, now: float, from_seq: int | None = None) -> list[Action]:
        """Start at ``now``; with ``from_seq``, catch up by a replay from that seq."""
        self._quiet_since = now
        if from_seq is None:
            return []
        return self.replay_from(from_seq, now)

    def replay_from(self, from_seq: int, now: float) -> list[Action]:
        """Forget the position and ask for a replay from ``from_seq`` (e.g. after the
        consumer lost its state)."""
        self._last = from_seq - 1
        self._attempts = 0
        self._ask(from_seq, now)
        return self._take()

    def live(self, frames: list[bytes], now: float) -> list[Action]:
        """Take one live message: ``[topic, seq, payload]`` (notes 4 and 5)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed(None, f"live message of {len(frames)} frames")
            return self._take()
        seq = unpack_seq(frames[1])
        batch = self._decode(seq, frames[2])
        if batch is None:
            return self._take()
        self._quiet_since = now
        last = self._last
        if self._waiting:
            if seq in self._held:
                self.stats.duplicates += 1
            elif last is not None and seq == last + 1:
                self._drop_strays()
                self._deliver(seq, batch, replayed=False)
            else:
                self._held[seq] = batch
            return self._take()
        if last is None or seq == last + 1:
            self._deliver(seq, batch, replayed=False)
        elif seq <= last:
            self.stats.restarts += 1
            self._out.append(Restarted(last, seq))
            self._last = None
            if seq == 0:
                self._deliver(seq, batch, replayed=False)
            else:
                self._gap(0, seq, batch, now)
        else:
            self._gap(last + 1, seq, batch, now)
        return self._take()

    def replayed(self, frames: list[bytes], now: float) -> list[Action]:
        """Take one message from the replay socket: ``[b"", (topic,) seq, payload]``."""
        if self._replay_from is None:
            return self._take()  # the tail of a replay given up on
        if len(frames) < 3 or frames[0] != b"" or len(frames[-2]) != 8:
            self._malformed(None, f"replay reply of {len(frames)} frames")
            return self._take()
        seq_frame, payload = frames[-2], frames[-1]
        if seq_frame == REPLAY_END_SEQ:
            self._end_replay()
            self._merge_held(now)
            return self._take()
        seq = unpack_seq(seq_frame)
        if seq >= SEQ_LIMIT:
            self._malformed(seq, f"seq {seq} is out of range (at most {SEQ_LIMIT - 1})")
            return self._take()
        expected = (self._last + 1) if self._last is not None else self._replay_from
        if seq < expected:
            self.stats.duplicates += 1
            return self._take()
        if seq > expected:
            self._lost(expected, seq, "replay buffer no longer holds it")
        batch = self._decode(seq, payload)
        if batch is None:  # the publisher's own record: its seq is used up (note 4)
            self._last = seq
            self._progress = True
            return self._take()
        self.stats.replayed += 1
        self._deliver(seq, batch, replayed=True)
        return self._take()

    def tick(self, now: float) -> list[Action]:
        """Act on the clock: give up a replay past its timeout, send a due retry or probe."""
        if self._replay_from is not None:
            if now >= self._replay_deadline:
                self._give_up_replay("replay timed out", now)
        elif self._retry_at is not None:
            if now >= self._retry_at:
                self.stats.replay_retries += 1
                self._ask(self._retry_from, now)
        else:
            deadline = self.deadline
            if deadline is not None and now >= deadline:
                assert self._last is not None, "probe deadline without a position"
                self._quiet_since = now
                if self._last + 1 < SEQ_LIMIT:  # past the last seq only a restart can come
                    self.stats.probes += 1
                    self._ask(self._last + 1, now, probe=True)
        return self._take()

    # -- rules ------------------------------------------------------------------------------

    @property
    def _waiting(self) -> bool:
        return self._replay_from is not None or self._retry_at is not None

    def _gap(self, expected: int, seq: int, batch: Batch, now: float) -> None:
        self.stats.gaps += 1
        self._out.append(GapDetected(expected, seq))
        if not self._has_replay:
            self._lost(expected, seq, "no replay endpoint")
            self._deliver(seq, batch, replayed=False)
            return
        self._last = expected - 1
        self._held[seq] = batch
        self._attempts = 1
        self._ask(expected, now)

    def _ask(self, start: int, now: float, *, probe: bool = False) -> None:
        if not self._has_replay:
            return
        if not probe:
            self.stats.replays += 1
        self._replay_from = start
        self._probing = probe
        self._retry_at = None
        self._progress = False
        self._replay_deadline = now + self._replay_timeout
        self._out.append(ReplayRequest(start))

    def _end_replay(self) -> None:
        self._replay_from = None
        self._probing = False

    def _drop_strays(self) -> None:
        """A live batch continued the stream while others were held above it (note 5)."""
        for seq in sorted(self._held):
            self._malformed(seq, "batch ahead of the live stream, out of order")
        self._held = {}
        self._end_replay()
        self._retry_at = None
        self._attempts = 0

    def _give_up_replay(self, reason: str, now: float) -> None:
        expected = (self._last + 1) if self._last is not None else 0
        probing = self._probing
        self._end_replay()
        resumed = min(self._held) if self._held else None
        if probing and (resumed is None or resumed == expected):
            # A probe's question went unanswered and no batch says anything is missing.
            self.stats.probe_timeouts += 1
            self._quiet_since = now  # the next probe after another quiet spell
        elif resumed is None or resumed > expected:
            self._lost(expected, resumed, reason)
            self._last = None if resumed is None else resumed - 1
        self._merge_held(now)

    def _merge_held(self, now: float) -> None:
        held, self._held = self._held, {}
        for seq in sorted(held):
            last = self._last
            if last is not None and seq <= last:
                self.stats.duplicates += 1
            elif last is None or seq == last + 1:
                self._deliver(seq, held[seq], replayed=False)
            else:
                # Held batches still miss something: live batches lost after the replay's
                # snapshot, or a replay that did not cover the gap (note 2).
                self._held = {s: p for s, p in held.items() if s >= seq}
                self._regap(last + 1, seq, now)
                return
        self._attempts = 0

    def _regap(self, expected: int, seq: int, now: float) -> None:
        if self._progress or self._attempts == 0:  # a new gap: ask at once
            self.stats.gaps += 1
            self._out.append(GapDetected(expected, seq))
            self._attempts = 1
            self._ask(expected, now)
            return
        if self._attempts >= self._max_attempts:
            self._attempts = 0
            self._lost(expected, seq, "replay did not cover the gap")
            self._last = seq - 1
            self._merge_held(now)
            return
        delay = self._retry_delay * 2 ** (self._attempts - 1)
        self._attempts += 1
        self._retry_from = expected
        self._retry_at = now + min(delay, self._max_retry_delay)

    # -- outputs ----------------------------------------------------------------------------

    def _decode(self, seq: int, payload: bytes) -> Batch | None:
        """The batch in ``payload``, or None (counted as malformed) when it is unusable."""
        if seq >= SEQ_LIMIT:
            self._malformed(seq, f"seq {seq} is out of range (at most {SEQ_LIMIT - 1})")
            return None
        try:
            return decode_batch(payload, self.decode_stats)
        except MalformedBatch as exc:
            self._malformed(seq, str(exc))
            return None

    def _deliver(self, seq: int, batch: Batch, *, replayed: bool) -> None:
        self._last = seq
        self._progress = True
        self.stats.delivered += 1
        self._out.append(Delivered(seq, batch, replayed))

    def _lost(self, first_missing: int, resumed_at: int | None, reason: str) -> None:
        self.stats.history_lost += 1
        self._out.append(HistoryLost(first_missing, resumed_at, reason))

    def _malformed(self, seq: int | None, reason: str) -> None:
        self.stats.malformed += 1
        self._out.append(MalformedInput(seq, reason))

    def _take(self) -> list[Action]:
        out, self._out = self._out, []
        return out
