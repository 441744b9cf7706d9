"""Subscribes to one engine's KV event stream, in order, recovering loss by replay.

Per worker rank: a SUB socket on the live stream and, when the engine offers one, a DEALER on
its replay endpoint (``docs/wire.md``). This module is the socket shell: it receives frames,
reads the clock, and hands both to :class:`~router.events.sequencer.StreamSequencer`, which decides
what they mean (the notices are described there); it sends the replay requests the sequencer
asks for and passes each notice, in order, to one callback.

Each socket has a monitor. libzmq drops a connection that carries a message over
``max_message_bytes`` and, unlike a connection the publisher closed, does not reconnect it; a
drop that no reconnect attempt follows within :data:`RECONNECT_GRACE` seconds is counted
(``stats.oversize``) and the socket reconnected, and the batches lost with the connection come
back as a gap, by replay. A failed handshake (CURVE keys the publisher refuses) is counted
(``stats.handshake_failures``) and tried again every :data:`HANDSHAKE_RETRY` seconds.

The subscriber never dies of input: every frame goes through one ``try`` that counts and skips.
Should its task end all the same (a bug, a socket closed under it), the error is logged and
kept in :attr:`EventSubscriber.failure`, which the registry reads on every health check: the
worker is then unhealthy with that reason, and subscribed afresh when it next answers.
:meth:`EventSubscriber.stop` cancels the task and closes the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.wire import pack_seq
from router.events.sequencer import (
    Action,
    Delivered,
    GapDetected,
    HistoryLost,
    MalformedInput,
    Notice,
    ReplayRequest,
    Restarted,
    StreamSequencer,
    SubscriberStats,
)
from router.events.transport import EventTransport

__all__ = [
    "Delivered",
    "EventSubscriber",
    "GapDetected",
    "HistoryLost",
    "MalformedInput",
    "Notice",
    "Restarted",
    "SubscriberStats",
]

log = logging.getLogger(__name__)

#: Seconds after a dropped connection within which libzmq announces its own reconnect; without
#: one the drop was libzmq refusing a message (over the size limit) and the shell reconnects.
RECONNECT_GRACE = 0.2
#: Seconds before trying again after a failed handshake (keys the peer refuses).
HANDSHAKE_RETRY = 2.0


class _Link:
    """One connected socket, its endpoint and its monitor.

    libzmq does not reconnect a connection it dropped for a protocol error: a message over
    ``MAXMSGSIZE``, or a failed handshake (a CURVE key the peer refuses). The link sees both
    on its monitor and tells the shell when to reconnect (:meth:`due`).
    """

    _HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                         | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    _WATCHED = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
                | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)

    def __init__(self, sock: zmq.asyncio.Socket, endpoint: str) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.monitor: zmq.asyncio.Socket = sock.get_monitor_socket(self._WATCHED)
        self.dropped_at: float | None = None  # a drop libzmq may yet announce a retry for
        self.retry_at: float | None = None  # reconnect then, after a failed handshake
        self._handshake_failed = False
        sock.connect(endpoint)

    def watch(self, event: int, now: float, stats: SubscriberStats) -> None:
        if event & self._HANDSHAKE_FAILED:
            stats.handshake_failures += 1
            if not self._handshake_failed:
                log.warning("handshake with %s failed (event %#x): check the CURVE keys",
                            self.endpoint, event)
            self._handshake_failed = True
        elif event == zmq.EVENT_DISCONNECTED:
            if self._handshake_failed:
                self.retry_at = now + HANDSHAKE_RETRY
            else:
                self.dropped_at = now
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.dropped_at = None  # libzmq reconnects by itself: the peer went away
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._handshake_failed = False

    def due(self) -> float | None:
        """When :meth:`check` has something to do."""
        times = [t for t in (self.retry_at,
                             None if self.dropped_at is None
                             else self.dropped_at + RECONNECT_GRACE) if t is not None]
        return min(times) if times else None

    def check(self, now: float, stats: SubscriberStats, limit: int) -> None:
        """Reconnect a connection libzmq dropped and will not reopen."""
        if self.dropped_at is not None and now >= self.dropped_at + RECONNECT_GRACE:
            stats.oversize += 1
            log.warning("%s sent a message over %d bytes; reconnecting", self.endpoint, limit)
            self._reconnect()
        elif self.retry_at is not None and now >= self.retry_at:
            self._reconnect()

    def _reconnect(self) -> None:
        self.dropped_at = self.retry_at = None
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disconnect(self.endpoint)
        self.sock.connect(self.endpoint)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


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
        transport: size limits and CURVE keys of the sockets.
        context: a ZeroMQ asyncio context; a private one by default.
        **sequencing: further :class:`~router.events.sequencer.StreamSequencer` settings (replay
            retry delays and attempts).
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
        transport: EventTransport | None = None,
        context: zmq.asyncio.Context | None = None,
        **sequencing: float,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._on_notice = on_notice
        self._topic = topic.encode()
        self._from_seq = from_seq
        self._transport = transport or EventTransport()
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._sub: _Link | None = None
        self._dealer: _Link | None = None
        self._task: asyncio.Task[None] | None = None
        #: Why the receiving task ended, if it did (module docstring); None while it runs.
        self.failure: str | None = None
        self._sequencer = StreamSequencer(replay=replay_endpoint is not None,
                                          replay_timeout=replay_timeout,
                                          probe_interval=probe_interval,
                                          **sequencing)  # type: ignore[arg-type]
        self.stats: SubscriberStats = self._sequencer.stats
        self.decode_stats = self._sequencer.decode_stats

    @property
    def last_seq(self) -> int | None:
        """The last seq delivered, or ``None`` before the first."""
        return self._sequencer.last_seq

    async def start(self) -> None:
        """Connect and start the receiving task."""
        if self._task is not None:
            raise RuntimeError("subscriber already started")
        sub = self._context.socket(zmq.SUB)
        self._transport.apply(sub)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub = _Link(sub, self.endpoint)
        if self.replay_endpoint is not None:
            dealer = self._context.socket(zmq.DEALER)
            self._transport.apply(dealer)
            self._dealer = _Link(dealer, self.replay_endpoint)
        await self._act(self._sequencer.begin(time.monotonic(), self._from_seq))
        self._task = asyncio.create_task(self._run(), name=f"kv-sub {self.endpoint}")

    async def stop(self) -> None:
        """Cancel the task and close the sockets; safe to call twice."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for link in (self._sub, self._dealer):
            if link is not None:
                link.close()
        self._sub = self._dealer = None
        if self._own_context:
            self._context.term()
            self._own_context = False

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._receive()
        except Exception as exc:  # CancelledError (stop) is not an Exception
            self.failure = (f"event subscriber for {self.endpoint} stopped: "
                            f"{type(exc).__name__}: {exc}")
            log.exception("event subscriber for %s stopped", self.endpoint)

    async def _receive(self) -> None:
        assert self._sub is not None, "run before start"
        links = [link for link in (self._sub, self._dealer) if link is not None]
        poller = zmq.asyncio.Poller()
        for link in links:
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
        while True:
            deadlines = [d for d in (self._sequencer.deadline, *(ln.due() for ln in links))
                         if d is not None]
            timeout_ms = None
            if deadlines:
                timeout_ms = max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)
            ready = dict(await poller.poll(timeout_ms))
            for link in links:
                if link.monitor in ready:
                    await self._watch(link)
            if self._sub.sock in ready:
                await self._drain(self._sub.sock, self._sequencer.live)
            if self._dealer is not None and self._dealer.sock in ready:
                await self._drain(self._dealer.sock, self._sequencer.replayed)
            now = time.monotonic()
            for link in links:
                link.check(now, self.stats, self._transport.max_message_bytes)
            await self._act(self._sequencer.tick(now))

    async def _watch(self, link: _Link) -> None:
        while True:
            try:
                frames = await link.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(frames)
            except (ValueError, IndexError, TypeError):
                continue
            link.watch(int(event["event"]), time.monotonic(), self.stats)

    async def _drain(self, sock: zmq.asyncio.Socket,
                     handle: Callable[[list[bytes], float], list[Action]]) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                await self._act(handle(frames, time.monotonic()))
            except Exception as exc:  # input must never stop the subscriber
                self.stats.malformed += 1
                log.warning("skipping unusable frames from %s: %s", self.endpoint, exc)

    async def _act(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, ReplayRequest):
                assert self._dealer is not None, "replay requested without a replay socket"
                await self._dealer.sock.send_multipart((b"", pack_seq(action.start)))
            else:
                self._notify(action)

    def _notify(self, notice: Notice) -> None:
        try:
            self._on_notice(notice)
        except Exception:  # a consumer bug must not stop the stream
            self.stats.callback_errors += 1
            log.exception("KV event callback failed on %s", type(notice).__name__)
