"""``kvroute keys generate DIR``: write a CURVE keypair for the KV event plane.

Writes ``DIR/NAME.key`` (the public certificate, safe to copy around) and
``DIR/NAME.key_secret`` (the secret certificate, readable by its owner only), in ZeroMQ's
certificate format. One keypair serves the workers (``--curve-secret-key`` on each worker;
its ``.key`` is the routers' ``--curve-server-key``) and one each router
(``--curve-secret-key`` on the router; its ``.key`` goes into the workers'
``--curve-authorized-clients`` folder).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import zmq.auth

__all__ = ["add_keys_parser", "generate_keypair", "run_keys"]


def generate_keypair(folder: str | Path, name: str) -> tuple[Path, Path]:
    """Write a new keypair as ``folder/name.key`` and ``folder/name.key_secret``.

    Returns:
        The public and the secret certificate's paths.

    Raises:
        ValueError: the name is not a plain file name.
        FileExistsError: either file exists already (keys are never overwritten).
    """
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"{name!r} is not a plain file name")
    directory = Path(folder)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists; keys are never overwritten")
    directory.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    public.chmod(0o644)
    secret.chmod(0o600)
    return public, secret


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``keys generate`` to the ``kvroute`` command."""
    keys = sub.add_parser("keys", help="manage CURVE keys of the KV event plane",
                          description="Writes CURVE keypairs for the KV event plane.")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    gen = ksub.add_parser(
        "generate", help="write a CURVE keypair (NAME.key, NAME.key_secret) into DIR",
        description="Writes a CURVE keypair in ZeroMQ's certificate format: NAME.key is the "
        "public half, NAME.key_secret the secret half (mode 600). Existing files are never "
        "overwritten.")
    gen.add_argument("dir", metavar="DIR", help="folder to write the keypair into")
    gen.add_argument("--name", default="kvroute", help="file name stem (default kvroute)")


def run_keys(args: argparse.Namespace) -> int:
    """Run ``kvroute keys``; returns the exit status."""
    try:
        public, secret = generate_keypair(args.dir, args.name)
    except (ValueError, OSError) as exc:
        print(f"kvroute keys generate: {exc}", file=sys.stderr)
        return 2
    print(f"public key: {public}\nsecret key: {secret}")
    return 0
