"""Subscribes to one engine's KV event stream, in order, recovering loss by replay.

Per worker rank: a SUB socket on the live stream and, when the engine offers one, a DEALER on
its replay endpoint (``shared/WIRE.md``). The subscriber tracks the sequence number and turns
what it sees into :data:`Notice` values handed, in order, to one callback:

- ``Delivered``: a batch, decoded; every seq exactly once, ascending, live or replayed.
- ``GapDetected``: a live seq jumped; a replay from the last seq + 1 is asked for. Live batches
  arriving meanwhile are held back and merged after the replay; duplicates are dropped.
- ``HistoryLost``: replay could not cover a gap (its first batch was above the seq asked for,
  it timed out, or there is no replay endpoint), or a catch-up replay asked for at start timed
  out. The caller must resynchronise that worker.
- ``Restarted``: the seq went backwards outside a replay: a new engine instance. The caller
  clears what it knew; the subscriber then expects seq 0 again.
- ``MalformedInput``: a frame or payload that could not be used; counted and skipped.

Loss at the end of a burst shows no gap until the next batch arrives, which may be long on an
idle engine. So when the live stream has been quiet for ``probe_interval`` seconds, the
subscriber asks for a replay from its last seq + 1 (a probe): an empty answer costs one round
trip, and batches the socket dropped arrive as a normal replay. A probe that goes unanswered
(a replay port that is wrong, firewalled or hung) is counted, not reported: nothing is known
lost, and a ``HistoryLost`` would have the router drop that worker's index at every quiet
spell. A live batch that continues the stream ends a probe at once, since it proves nothing
was lost before it.

The subscriber never dies of input: every frame goes through one ``try`` that counts and skips.
:meth:`EventSubscriber.stop` cancels the task and closes both sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import zmq
import zmq.asyncio

from indexer.decode import DecodeStats, MalformedBatch, decode_batch
from indexer.events import Batch
from indexer.wire import REPLAY_END_SEQ, pack_seq, unpack_seq

__all__ = [
    "Delivered",
    "EventSubscriber",
    "GapDetected",
    "HistoryLost",
    "MalformedInput",
    "Notice",
    "Restarted",
]

log = logging.getLogger(__name__)


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


Notice = Delivered | GapDetected | HistoryLost | Restarted | MalformedInput


class SubscriberStats:
    """Counters of one subscription."""

    __slots__ = (
        "callback_errors",
        "delivered",
        "duplicates",
        "gaps",
        "history_lost",
        "malformed",
        "probe_timeouts",
        "probes",
        "replayed",
        "replays",
        "restarts",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        """Return the counters by name."""
        return {name: getattr(self, name) for name in self.__slots__}


class EventSubscriber:
    """One engine rank's event stream, ordered and gap-checked.

    Args:
        endpoint: the engine's PUB endpoint, e.g. ``tcp://127.0.0.1:5557``.
        on_notice: called in order with every :data:`Notice`; exceptions are logged and counted.
        replay_endpoint: the engine's replay ROUTER endpoint, or ``None``.
        topic: topic prefix to subscribe to (empty: everything).
        from_seq: when set, replay from this seq at start (0: the engine's whole history, if
            its buffer still holds it), so a late subscriber catches up.
        replay_timeout: seconds to wait for a replay's end marker before giving up on it.
        probe_interval: quiet seconds after which a replay probe checks for trailing loss;
            ``None`` disables probing.
        context: a ZeroMQ asyncio context; a private one by default.
    """

    def __init__(
        self,
        endpoint: str,
        on_notice: Callable[[Notice], None],
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        from_seq: int | None = None,
        replay_timeout: float = 2.0,
        probe_interval: float | None = 1.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._on_notice = on_notice
        self._topic = topic.encode()
        self._from_seq = from_seq
        self._replay_timeout = replay_timeout
        self._probe_interval = probe_interval
        self._quiet_since = time.monotonic()
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._last: int | None = None
        self._replay_from: int | None = None  # seq asked for, while a replay is in flight
        self._probing = False  # the replay in flight is a probe
        self._replay_deadline = 0.0
        self._held: dict[int, bytes] = {}  # live batches held back during a replay
        self.stats = SubscriberStats()
        self.decode_stats = DecodeStats()

    @property
    def last_seq(self) -> int | None:
        """The last seq delivered, or ``None`` before the first."""
        return self._last

    async def start(self) -> None:
        """Connect and start the receiving task."""
        if self._task is not None:
            raise RuntimeError("subscriber already started")
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self.endpoint)
        self._sub = sub
        if self.replay_endpoint is not None:
            dealer = self._context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_endpoint)
            self._dealer = dealer
        if self._from_seq is not None:
            self._last = self._from_seq - 1
            await self._ask_replay(self._from_seq)
        self._task = asyncio.create_task(self._run(), name=f"kv-sub {self.endpoint}")

    async def stop(self) -> None:
        """Cancel the task and close the sockets; safe to call twice."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None
        if self._own_context:
            self._context.term()
            self._own_context = False

    async def request_replay(self, from_seq: int) -> None:
        """Ask for a replay from ``from_seq`` now (e.g. after the caller lost its state)."""
        self._last = from_seq - 1
        await self._ask_replay(from_seq)

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        poller = zmq.asyncio.Poller()
        assert self._sub is not None, "run before start"
        poller.register(self._sub, zmq.POLLIN)
        if self._dealer is not None:
            poller.register(self._dealer, zmq.POLLIN)
        while True:
            deadline = self._next_deadline()
            timeout_ms = None
            if deadline is not None:
                timeout_ms = max(0, int((deadline - time.monotonic()) * 1000) + 1)
            ready = dict(await poller.poll(timeout_ms))
            if self._sub in ready:
                self._quiet_since = time.monotonic()
                await self._drain(self._sub, self._on_live)
            if self._dealer is not None and self._dealer in ready:
                await self._drain(self._dealer, self._on_replay)
            if self._replay_from is not None and time.monotonic() >= self._replay_deadline:
                await self._give_up_replay("replay timed out")
            elif self._probe_due():
                self.stats.probes += 1
                self._quiet_since = time.monotonic()
                await self._ask_replay(self._last + 1, probe=True)  # type: ignore[operator]

    def _next_deadline(self) -> float | None:
        if self._replay_from is not None:
            return self._replay_deadline
        if self._dealer is None or self._probe_interval is None or self._last is None:
            return None
        return self._quiet_since + self._probe_interval

    def _probe_due(self) -> bool:
        deadline = self._next_deadline()
        return (self._replay_from is None and deadline is not None
                and time.monotonic() >= deadline)

    async def _drain(self, sock: zmq.asyncio.Socket, handle: Callable[[list[bytes]], object]
                     ) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                step = handle(frames)
                if asyncio.iscoroutine(step):
                    await step
            except Exception as exc:  # input must never stop the subscriber
                self.stats.malformed += 1
                log.warning("skipping unusable frames from %s: %s", self.endpoint, exc)

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed(None, f"live message of {len(frames)} frames")
            return
        seq, payload = unpack_seq(frames[1]), frames[2]
        if self._replay_from is not None:
            if self._probing and not self._held and self._last is not None \
                    and seq == self._last + 1:
                self._end_replay()  # the stream goes on where it was: nothing was lost
            else:
                self._held[seq] = payload
                return
        last = self._last
        if last is None or seq == last + 1:
            self._deliver(seq, payload, replayed=False)
        elif seq <= last:
            self.stats.restarts += 1
            self._notify(Restarted(last, seq))
            self._last = None
            if seq == 0:
                self._deliver(seq, payload, replayed=False)
            else:
                await self._gap(0, seq, payload)
        else:
            await self._gap(last + 1, seq, payload)

    async def _gap(self, expected: int, seq: int, payload: bytes) -> None:
        self.stats.gaps += 1
        self._notify(GapDetected(expected, seq))
        if self._dealer is None:
            self._lost(expected, seq, "no replay endpoint")
            self._deliver(seq, payload, replayed=False)
            return
        self._last = expected - 1
        self._held[seq] = payload
        await self._ask_replay(expected)

    async def _ask_replay(self, start: int, *, probe: bool = False) -> None:
        if self._dealer is None:
            return
        if not probe:
            self.stats.replays += 1
        self._replay_from = start
        self._probing = probe
        self._replay_deadline = time.monotonic() + self._replay_timeout
        await self._dealer.send_multipart((b"", pack_seq(start)))

    async def _on_replay(self, frames: list[bytes]) -> None:
        if self._replay_from is None:
            return  # the tail of a replay we gave up on
        if len(frames) < 3 or frames[0] != b"":
            self._malformed(None, f"replay reply of {len(frames)} frames")
            return
        seq_frame, payload = frames[-2], frames[-1]
        if seq_frame == REPLAY_END_SEQ:
            self._end_replay()
            await self._merge_held()
            return
        seq = unpack_seq(seq_frame)
        expected = (self._last + 1) if self._last is not None else self._replay_from
        if seq < expected:
            self.stats.duplicates += 1
            return
        if seq > expected:
            self._lost(expected, seq, "replay buffer no longer holds it")
        self.stats.replayed += 1
        self._deliver(seq, payload, replayed=True)

    def _end_replay(self) -> None:
        self._replay_from = None
        self._probing = False

    async def _give_up_replay(self, reason: str) -> None:
        expected = (self._last + 1) if self._last is not None else 0
        probing = self._probing
        self._end_replay()
        resumed = min(self._held) if self._held else None
        if probing and (resumed is None or resumed == expected):
            # A probe's question went unanswered and no batch says anything is missing.
            self.stats.probe_timeouts += 1
            self._quiet_since = time.monotonic()  # the next probe after another quiet spell
        elif resumed is None or resumed > expected:
            self._lost(expected, resumed, reason)
            self._last = None if resumed is None else resumed - 1
        await self._merge_held()

    async def _merge_held(self) -> None:
        held, self._held = self._held, {}
        for seq in sorted(held):
            last = self._last
            if last is not None and seq <= last:
                self.stats.duplicates += 1
            elif last is None or seq == last + 1:
                self._deliver(seq, held[seq], replayed=False)
            else:
                # Live batches were lost after the replay's snapshot: replay again from there.
                self._held = {s: p for s, p in held.items() if s >= seq}
                self.stats.gaps += 1
                self._notify(GapDetected(last + 1, seq))
                await self._ask_replay(last + 1)
                return

    # -- outputs ----------------------------------------------------------------------------

    def _deliver(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self._last = seq
        try:
            batch = decode_batch(payload, self.decode_stats)
        except MalformedBatch as exc:
            self._malformed(seq, str(exc))
            return
        self.stats.delivered += 1
        self._notify(Delivered(seq, batch, replayed))

    def _lost(self, first_missing: int, resumed_at: int | None, reason: str) -> None:
        self.stats.history_lost += 1
        self._notify(HistoryLost(first_missing, resumed_at, reason))

    def _malformed(self, seq: int | None, reason: str) -> None:
        self.stats.malformed += 1
        self._notify(MalformedInput(seq, reason))

    def _notify(self, notice: Notice) -> None:
        try:
            self._on_notice(notice)
        except Exception:  # a consumer bug must not stop the stream
            self.stats.callback_errors += 1
            log.exception("KV event callback failed on %s", type(notice).__name__)
