"""The ``kvroute`` command: one entry point, one subcommand per job.

Each subcommand's module is imported only when it runs, so ``kvroute events`` works without the
router's web stack loaded and the worker never imports the router (they meet on the wire).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvroute import __version__


def _add_events(sub: argparse._SubParsersAction) -> None:
    events = sub.add_parser("events", help="inspect KV event streams")
    esub = events.add_subparsers(dest="events_command", required=True)
    tail = esub.add_parser(
        "tail",
        help="subscribe to an engine's KV events and print each batch, normalised",
        description="Subscribes to any engine that publishes KV events over ZeroMQ (kvroute "
        "workers, vLLM, TensorRT-LLM, SGLang) and prints each batch, normalised, with gaps, "
        "replays and restarts as they happen.",
    )
    tail.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                      help="the engine's PUB endpoint")
    tail.add_argument("--replay", metavar="tcp://HOST:PORT",
                      help="the engine's replay endpoint (enables gap recovery)")
    tail.add_argument("--topic", default="", help="topic prefix (default: everything)")
    tail.add_argument("--from-seq", type=_non_negative, metavar="N",
                      help="replay from seq N first (needs --replay)")
    tail.add_argument("--count", type=_positive, metavar="N",
                      help="exit after N batches")
    tail.add_argument("--timeout", type=float, metavar="SECONDS",
                      help="exit with status 3 if nothing arrives for this long")
    tail.add_argument("--json", action="store_true",
                      help="one JSON object a line (default: readable lines)")


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="kvroute", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_events(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvroute`` command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "events":
        from kvroute.events_tail import run_tail

        if args.from_seq is not None and not args.replay:
            print("kvroute events tail: --from-seq needs --replay", file=sys.stderr)
            return 2
        return run_tail(args)
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
