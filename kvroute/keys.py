"""``kvroute keys generate DIR``: write a CURVE keypair for the KV event plane;
``kvroute keys hash``: the keys file's line for a client API key (:mod:`httpapi.api_keys`).

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

from httpapi.api_keys import generate_key, hash_line

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
    keys = sub.add_parser("keys", help="CURVE keys of the KV event plane; client API key "
                          "hashes", description="Writes CURVE keypairs for the KV event "
                          "plane, and hashes client API keys for the router.")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    gen = ksub.add_parser(
        "generate", help="write a CURVE keypair (NAME.key, NAME.key_secret) into DIR",
        description="Writes a CURVE keypair in ZeroMQ's certificate format: NAME.key is the "
        "public half, NAME.key_secret the secret half (mode 600). Existing files are never "
        "overwritten.")
    gen.add_argument("dir", metavar="DIR", help="folder to write the keypair into")
    gen.add_argument("--name", default="kvroute", help="file name stem (default kvroute)")
    hashed = ksub.add_parser(
        "hash", help="print the --api-keys-file line of a client API key",
        description="Reads a client API key from standard input (one line; never from the "
        "command line, where ps shows it) and prints its line for the router's "
        "--api-keys-file: a salted SHA-256 hash, with its name and quota. With --generate, "
        "makes a new random key instead and prints it first, on standard error.")
    hashed.add_argument("--name", help="the key's name in the router's metrics "
                        "(default: counted as 'other')")
    hashed.add_argument("--tpm", type=int, metavar="TOKENS",
                        help="the key's prompt tokens per minute; 0: no limit (default: the "
                        "router's --api-key-tokens-per-minute)")
    hashed.add_argument("--generate", action="store_true",
                        help="make a new random key (256 bits) instead of reading one")


def run_keys(args: argparse.Namespace) -> int:
    """Run ``kvroute keys``; returns the exit status."""
    if args.keys_command == "hash":
        return _run_hash(args)
    try:
        public, secret = generate_keypair(args.dir, args.name)
    except (ValueError, OSError) as exc:
        print(f"kvroute keys generate: {exc}", file=sys.stderr)
        return 2
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


def _run_hash(args: argparse.Namespace) -> int:
    key = generate_key() if args.generate else sys.stdin.readline().strip()
    try:
        line = hash_line(key, args.name, args.tpm)
    except ValueError as exc:
        print(f"kvroute keys hash: {exc}", file=sys.stderr)
        return 2
    if args.generate:
        print(f"key (shown once): {key}", file=sys.stderr)
    print(line)
    return 0
