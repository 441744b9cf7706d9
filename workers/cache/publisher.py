"""ZeroMQ publisher of KV event batches, in vLLM 0.33's transport form (``docs/wire.md``).

Two sockets per data-parallel rank:

- PUB at ``endpoint``: every batch as ``[topic, seq (8 bytes big-endian), payload]``. PUB/SUB is
  lossy by design (high-water-mark drops); sequence numbers are how consumers see the loss.
- ROUTER at ``replay_endpoint`` (optional): a consumer's DEALER sends ``[b"", start_seq]`` and
  gets ``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq``, then
  ``[b"", b"", ff*8, b""]``. Anything else at the ROUTER is ignored with a warning.

Notes:
    1. Sequence numbers are assigned when a batch is sent: 0 for the first, +1 per batch.
    2. The replay buffer keeps the last ``buffer_batches`` sent batches (vLLM's default 10,000).
    3. Rank r binds ``port + r`` on both endpoints (:func:`shift_port`).
    4. :meth:`EventPublisher.drop_next` withholds batches from the live socket while still
       numbering and buffering them: the fault a consumer sees when a PUB socket drops at its
       high-water mark. Tests and the worker's fault-injection endpoint use it.
    5. Batches carry raw token ids: whoever reaches these ports reads every tenant's prompts.
       With :class:`CurveServerKeys` both sockets are CURVE servers: traffic is encrypted and
       a ZAP authenticator on the publisher's context admits only the client public keys in
       ``authorized_clients`` (a folder of ZeroMQ certificates). The authenticator is one per
       context, so a publisher with CURVE needs a context no other authenticator serves.
    6. Inbound messages (subscriptions, replay requests) are tiny; ``MAXMSGSIZE`` of
       :data:`MAX_INBOUND_BYTES` makes libzmq drop a peer that sends more.
    7. A ROUTER drops, silently, what it cannot queue for a peer: at its default send
       high-water mark (1,000 messages), a replay longer than that to a consumer busy
       elsewhere would lose every batch past the thousandth and its end marker. The replay
       ROUTER's mark is one whole replay: every buffered batch and the end marker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from indexer.wire import REPLAY_END_SEQ, KVEventBatch, encode_batch, pack_seq, unpack_seq

__all__ = ["CurveServerKeys", "EventPublisher", "shift_port"]

log = logging.getLogger(__name__)

DEFAULT_BUFFER_BATCHES = 10_000
DEFAULT_HWM = 100_000
MAX_INBOUND_BYTES = 4096
ZAP_DOMAIN = b"kvroute-events"


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """The publisher's CURVE keypair (Z85 bytes) and the folder of admitted client keys."""

    public: bytes
    secret: bytes = field(repr=False)
    authorized_clients: Path = Path()

    @classmethod
    def load(cls, secret_file: str | Path, authorized_clients: str | Path) -> CurveServerKeys:
        """Read the publisher's secret certificate; check the client key folder.

        Raises:
            ValueError: the file is missing or holds no secret key, or the folder is missing
                or holds no ``*.key`` certificate.
        """
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as exc:
            raise ValueError(f"CURVE key file: {exc}") from None
        if secret is None:
            raise ValueError(f"{secret_file} holds no secret key (use the .key_secret file)")
        folder = Path(authorized_clients)
        if not folder.is_dir() or not any(folder.glob("*.key")):
            raise ValueError(f"{folder} is not a folder of client public keys (*.key)")
        return cls(public, secret, folder)


def shift_port(endpoint: str, rank: int) -> str:
    """Return ``endpoint`` with its TCP port shifted by ``rank`` (data-parallel rank r uses
    ``port + r``). Non-TCP endpoints get ``-r`` appended for ranks above 0.

    Raises:
        ValueError: a TCP endpoint without a port.
    """
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}-{rank}"
    parts = urlsplit(endpoint)
    if parts.port is None:
        raise ValueError(f"endpoint {endpoint!r} has no port to shift by rank {rank}")
    host = parts.hostname or "*"
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{parts.port + rank}"


class EventPublisher:
    """Publishes :class:`~indexer.wire.KVEventBatch` values and serves replays.

    Args:
        endpoint: where the PUB socket binds, e.g. ``tcp://127.0.0.1:5557``.
        replay_endpoint: where the replay ROUTER binds; ``None`` for no replay.
        topic: the topic frame sent with every batch.
        buffer_batches: how many sent batches replay can serve.
        hwm: the PUB socket's send high-water mark.
        curve: CURVE keys: encrypt both sockets and admit only the authorized clients.
        context: a ZeroMQ asyncio context to use; a private one by default.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_batches: int = DEFAULT_BUFFER_BATCHES,
        hwm: int = DEFAULT_HWM,
        curve: CurveServerKeys | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if buffer_batches < 1:
            raise ValueError("buffer_batches must be at least 1")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._hwm = hwm
        self._curve = curve
        self._auth: AsyncioAuthenticator | None = None
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=buffer_batches
        )
        self._replay_hwm = buffer_batches + 1  # every buffered batch and the end marker
        self._next_seq = 0
        self._drop = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.sent = 0
        self.withheld = 0
        self.replays_served = 0
        self.bad_replay_requests = 0

    @property
    def next_seq(self) -> int:
        """The sequence number the next published batch gets."""
        return self._next_seq

    async def start(self) -> None:
        """Bind the sockets and start serving replays. Binding ``:0`` picks a free port, and
        :attr:`endpoint` / :attr:`replay_endpoint` then name the bound address."""
        if self._curve is not None:
            self._auth = AsyncioAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve(domain=ZAP_DOMAIN.decode(),
                                       location=str(self._curve.authorized_clients))
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        self._secure(pub)
        pub.bind(self.endpoint)
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub = pub
        if self.replay_endpoint is not None:
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.SNDHWM, self._replay_hwm)  # a whole replay (note 7)
            self._secure(router)
            router.bind(self.replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._router = router
            self._replay_task = asyncio.create_task(self._serve_replays(), name="kv-replay")

    async def close(self) -> None:
        """Stop serving replays and close both sockets; safe to call twice."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context:
            self._context.term()
            self._own_context = False

    def _secure(self, sock: zmq.asyncio.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        if self._curve is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def drop_next(self, batches: int) -> None:
        """Withhold the next ``batches`` batches from the live socket (they keep their seq and
        stay replayable), as a PUB socket at its high-water mark would."""
        if batches < 0:
            raise ValueError("batches must be >= 0")
        self._drop += batches

    async def publish(self, batch: KVEventBatch) -> int:
        """Number, buffer and send one batch; returns its seq once ZeroMQ has taken it.

        Raises:
            RuntimeError: the publisher is not started.
        """
        return await self.publish_payload(encode_batch(batch))

    async def publish_payload(self, payload: bytes) -> int:
        """Like :meth:`publish` for an already-encoded payload frame."""
        if self._pub is None:
            raise RuntimeError("publisher is not started")
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1
            self.withheld += 1
            return seq
        await self._pub.send_multipart((self._topic, pack_seq(seq), payload))
        self.sent += 1
        return seq

    async def _serve_replays(self) -> None:
        assert self._router is not None, "replay task started without a ROUTER socket"
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.bad_replay_requests += 1
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], unpack_seq(frames[2])
            self.replays_served += 1
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(
                        (identity, b"", self._topic, pack_seq(seq), payload)
                    )
            await router.send_multipart((identity, b"", b"", REPLAY_END_SEQ, b""))
