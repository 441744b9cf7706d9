"""``kvroute bench``: the benchmarks the ``kvroute`` command runs, by name.

The one way in from the command line: ``kvroute bench`` imports this module when it runs
(``importlib.import_module("bench.cli")``) and hands it every argument after ``bench``, so
``kvroute`` never imports ``bench`` at start and depends on none of its modules; ``bench``
imports ``kvroute`` (its argument types), not the other way round. Each benchmark keeps its
own flags: ``kvroute bench NAME --help`` lists them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["BENCHMARKS", "main"]

#: Each benchmark ``kvroute bench`` runs, with its one-line description.
BENCHMARKS = {"replay": "replay a trace over routing policies side by side (bench.replay)"}


def main(argv: Sequence[str]) -> int:
    """Run ``kvroute bench NAME ARGS...``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="kvroute bench", description="Benchmarks: "
        + "; ".join(f"{name}: {about}" for name, about in BENCHMARKS.items())
        + ". 'kvroute bench NAME --help' lists a benchmark's flags.")
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's flags")
    args = parser.parse_args(argv)
    from bench.replay import build_parser, run_bench

    assert args.benchmark == "replay", f"no runner for benchmark {args.benchmark!r}"
    return run_bench(build_parser(prog="kvroute bench replay").parse_args(args.args))
