"""API-key look-up cost: ``python -m bench.api_keys [--keys N] [--tries N]``.

CPU time (process time, so other load on the machine does not count) of
:meth:`httpapi.api_keys.KeyRing.identify` for a key the ring knows (remembered after its
first match), and for an unknown one with every line carrying its ``id=`` (as
``kvroute keys hash`` writes them) and with none (lines written by hand without it, every salt
tried). Prints one line per case, in µs a call.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from httpapi.api_keys import KeyRing, hash_line, parse_keys


def _per_call(ring: KeyRing, key: str, tries: int) -> float:
    started = time.process_time()
    for _ in range(tries):
        ring.identify(key)
    return (time.process_time() - started) / tries * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.api_keys")
    parser.add_argument("--keys", type=int, default=1000, help="keys in the ring")
    parser.add_argument("--tries", type=int, default=2000, help="calls per case")
    args = parser.parse_args(argv)
    lines = [hash_line(f"sk-bench-{i}", f"k{i}") for i in range(args.keys)]
    with_ids = KeyRing(parse_keys("\n".join(lines)))
    without = KeyRing(parse_keys("\n".join(line.split(" id=")[0] for line in lines)))
    with_ids.identify("sk-bench-1")
    print(f"known key, {args.keys} keys: {_per_call(with_ids, 'sk-bench-1', args.tries):.1f} "
          "us CPU a call")
    print(f"unknown key, {args.keys} keys with id=: "
          f"{_per_call(with_ids, 'sk-unknown', args.tries):.1f} us CPU a call")
    print(f"unknown key, {args.keys} keys without id=: "
          f"{_per_call(without, 'sk-unknown', max(args.tries // 10, 1)):.1f} us CPU a call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
