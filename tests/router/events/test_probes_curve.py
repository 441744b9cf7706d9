"""Probes of the router's CURVE key loading (:class:`router.events.transport.CurveClientKeys`):
missing, swapped, empty, garbled and short keys, a secret readable by others, and settings that
would fall back to plaintext. Every probe loads keys a socket takes, or is refused at start-up
with a ``ValueError`` (``SettingsError`` from the settings) that says what is wrong: never a
key that fails at the first connect, never plaintext when CURVE was asked for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from kvroute.keys import generate_keypair
from router.events.transport import CurveClientKeys, EventTransport
from router.settings import SettingsError, load_settings


@pytest.fixture
def pair(tmp_path: Path) -> dict[str, Path]:
    worker_pub, _ = generate_keypair(tmp_path / "worker", "worker")
    router_pub, router_secret = generate_keypair(tmp_path / "router", "router")
    return {"worker_pub": worker_pub, "router_pub": router_pub, "router_secret": router_secret,
            "dir": tmp_path}


def _write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def _public_line(path: Path) -> str:
    return next(line for line in path.read_text().splitlines() if "public-key" in line)


#: Each probe: what to pass as (secret file, server key file), and what the refusal says.
PROBES: dict[str, tuple[Callable[[dict[str, Path]], tuple[Path, Path]], str]] = {
    "a missing secret file": (lambda p: (p["dir"] / "nope.key_secret", p["worker_pub"]),
                              "CURVE key file"),
    "a missing server key": (lambda p: (p["router_secret"], p["dir"] / "nope.key"),
                             "CURVE key file"),
    "a public file for the secret": (lambda p: (p["router_pub"], p["worker_pub"]),
                                     "no secret key"),
    "an empty server key file": (lambda p: (p["router_secret"], _write(p["dir"] / "e.key", "")),
                                 "public key"),
    "a server key file of garbage": (lambda p: (p["router_secret"], _write(
        p["dir"] / "g.key", "this is not a certificate\n")), "public key"),
    "a short server key": (lambda p: (p["router_secret"], _write(
        p["dir"] / "s.key", 'curve\n    public-key = "abc"\n')), "public key"),
    "a server key not Z85": (lambda p: (p["router_secret"], _write(
        p["dir"] / "z.key", 'curve\n    public-key = "' + "~" * 40 + '"\n')), "public key"),
    "a directory for the secret": (lambda p: (p["dir"], p["worker_pub"]), "CURVE key file"),
    "a secret readable by others": (lambda p: (_chmod(p["router_secret"], 0o644),
                                               p["worker_pub"]), "readable"),
    "a secret key of the wrong length": (lambda p: (_write(
        p["dir"] / "w.key_secret", _public_line(p["router_pub"]) + '\n    secret-key = "'
        + "a" * 39 + '"\n'), p["worker_pub"]), "secret key"),
}


def _chmod(path: Path, mode: int) -> Path:
    path.chmod(mode)
    return path


@pytest.mark.parametrize(("files", "says"), PROBES.values(), ids=PROBES.keys())
def test_curve_key_probe(pair: dict[str, Path],
                         files: Callable[[dict[str, Path]], tuple[Path, Path]], says: str
                         ) -> None:
    secret, server = files(pair)
    with pytest.raises(ValueError) as refused:
        CurveClientKeys.load(secret, server)
    assert says in str(refused.value)


def test_good_keys_load_and_a_socket_takes_them(pair: dict[str, Path]) -> None:
    keys = CurveClientKeys.load(pair["router_secret"], pair["worker_pub"])
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    try:
        EventTransport(curve=keys).apply(sock)
        sock.connect("tcp://127.0.0.1:9")  # the keys are taken: connecting is queued
        assert sock.getsockopt(zmq.CURVE_SERVER) == 0  # a client, not a server
    finally:
        sock.close()


@pytest.mark.parametrize("given", ["curve_secret_key", "curve_server_key"])
def test_one_key_alone_is_no_plaintext_fallback(pair: dict[str, Path], given: str) -> None:
    path = pair["router_secret"] if given == "curve_secret_key" else pair["worker_pub"]
    with pytest.raises(SettingsError, match="go together"):
        load_settings({given: str(path)}, env={})


def test_an_empty_key_setting_is_refused_not_taken_as_none(pair: dict[str, Path]) -> None:
    with pytest.raises(SettingsError):
        load_settings({"curve_secret_key": "", "curve_server_key": str(pair["worker_pub"])},
                      env={"KVROUTE_CURVE_SECRET_KEY": ""})
