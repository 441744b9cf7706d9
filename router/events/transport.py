"""How the router's sockets on a worker's event plane are set up: size limits and CURVE.

KV events carry raw token ids, so whoever reads a worker's PUB or replay port reads every
tenant's prompts. With CURVE (``--curve-secret-key`` and ``--curve-server-key``) the router's
SUB and DEALER sockets encrypt and authenticate: they connect only to a publisher holding the
server key's secret half, and the publisher admits only the client keys it was given
(``workers/cache/publisher.py``). Key files are ZeroMQ certificates, as ``kvroute keys
generate`` writes them.

Limits: ``max_message_bytes`` (``zmq.MAXMSGSIZE``) bounds one message, so a publisher cannot
make the router allocate without bound; libzmq drops the connection carrying an oversize
message and the subscriber reconnects, counts it, and recovers the batches lost with it by
replay. ``receive_hwm`` bounds queued messages per socket; a batch dropped at the mark is a gap,
recovered the same way.

Keys are checked when the settings are read, so a bad one stops the start with its reason
rather than failing the first connect: each must be a 40-character Z85 key (32 bytes), and the
secret certificate must give other users no access (``kvroute keys generate`` writes it 0600;
a Kubernetes Secret volume wants ``defaultMode: 0440`` or tighter, its group being the pod's
``fsGroup``), as SSH wants of a private key. Without both files the router does not start: it
never falls back to plaintext.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_RECEIVE_HWM", "CurveClientKeys",
           "EventTransport"]

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_RECEIVE_HWM = 4096


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """The router's CURVE keypair and the workers' server public key (Z85 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes = b""

    @classmethod
    def load(cls, secret_file: str | Path, server_key_file: str | Path) -> CurveClientKeys:
        """Read the router's secret certificate and the workers' public certificate.

        Raises:
            ValueError: a file is missing, unreadable, or lacks the key it must hold.
        """
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
            server_public, _ = zmq.auth.load_certificate(server_key_file)
            mode = Path(secret_file).stat().st_mode
        except (OSError, ValueError) as exc:
            raise ValueError(f"CURVE key file: {exc}") from None
        if secret is None:
            raise ValueError(f"{secret_file} holds no secret key (use the .key_secret file)")
        if mode & 0o007:
            raise ValueError(f"CURVE secret key file {secret_file} is readable by other users "
                             f"(mode {mode & 0o777:o}): chmod 600 it")
        _check_key(public, "public key", secret_file)
        _check_key(secret, "secret key", secret_file)
        _check_key(server_public, "public key", server_key_file)
        return cls(public, secret, server_public)


def _check_key(key: bytes | None, what: str, path: str | Path) -> None:
    """Raise ``ValueError`` unless ``key`` is a Z85 CURVE key (40 characters, 32 bytes)."""
    try:
        ok = key is not None and len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError, struct.error):
        ok = False
    if not ok:
        raise ValueError(f"{path}: the {what} is not a 40-character Z85 CURVE key")


@dataclass(frozen=True, slots=True)
class EventTransport:
    """Socket options for one subscription's SUB and DEALER sockets."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    receive_hwm: int = DEFAULT_RECEIVE_HWM
    curve: CurveClientKeys | None = None

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be positive")
        if self.receive_hwm <= 0:
            raise ValueError("receive_hwm must be positive")

    def apply(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Set the limits and, with CURVE, the client keys on ``sock`` (before connect)."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, self.receive_hwm)
        if self.curve is not None:
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret)
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.curve.server_public)
