"""CPU time of one request body's parse (:func:`openai_request.bodies.parse_body`): msgspec's
decode, and the repeated-key check beside it (a count of colons against the decoded keys,
and ``json.loads`` with a pairs hook where the count cannot tell), on chat bodies of about
5 KB, 270 KB and 3 MB. Prints microseconds of process CPU time per parse,
each figure the best of five rounds, so other processes on the machine count little.

    python -m bench.parse_body
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import msgspec

from openai_request.bodies import parse_body

#: Repeats of the message text, for bodies of about 5 KB, 270 KB and 3 MB.
SIZES = (1, 50, 600)


def _body(repeats: int) -> bytes:
    text = "hello wörld " * (repeats * 80)
    return json.dumps({"model": "m", "max_tokens": 10, "stream": True,
                       "messages": [{"role": "user", "content": text}] * 4}).encode()


def _cpu_us(run: Callable[[], object], budget_s: float = 0.2) -> float:
    best = float("inf")
    for _ in range(5):
        start, n = time.process_time(), 0
        while time.process_time() - start < budget_s / 5:
            run()
            n += 1
        best = min(best, (time.process_time() - start) / n * 1e6)
    return best


def main() -> None:
    print("body bytes | msgspec decode (us) | parse_body (us)")
    for repeats in SIZES:
        raw = _body(repeats)
        decode = _cpu_us(lambda raw=raw: msgspec.json.decode(raw))
        whole = _cpu_us(lambda raw=raw: parse_body(raw))
        print(f"{len(raw)} | {decode:.1f} | {whole:.1f}")


if __name__ == "__main__":
    main()
