"""How much of each policy's hit its requests waited for.

A router can raise its hit rate by sending a request to the worker holding its prefix however
long that worker's queue is: the tokens count as cached, and the request's time to first
token pays for them. The hit rate alone does not show which. This splits it: per policy, the
prompt tokens found cached in requests whose TTFT exceeded each threshold, as points of the
whole run's hit, and the hit left without them: the run's hit had those requests found
nothing cached (what recomputing them elsewhere would have kept).

``python -m bench.hit_by_wait --trace FILE --workers 4 --capacity-tokens 300000 --rate-scale 4``
takes the workload, cluster and policy flags of :mod:`bench.replay` (``--policies``, default
``kvroute``; ``--set``), plus ``--over`` (the thresholds in seconds, default ``1,2.4,5``), and
prints one row per policy and threshold. A live run of :mod:`bench.replay` (``--live``)
prints the same rows for what its client saw. Run on the trace's last 393 requests at 3.6-4.8x its
rate (``docs/experiments.md``, "The hit bought by waiting").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["HEADER", "Served", "Split", "line", "main", "split"]

#: Seconds of TTFT the hit is split at by default.
DEFAULT_OVER = (1.0, 2.4, 5.0)


class Served(Protocol):
    """What :func:`split` reads of a request: a simulated one
    (:class:`bench.sim.RequestRecord`) or a live one (:class:`bench.live.LiveRecord`)."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    @property
    def ttft_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Split:
    """A run's hit at one TTFT threshold."""

    over_s: float
    #: Prompt tokens found cached, over all prompt tokens.
    hit: float
    #: Requests whose TTFT exceeded ``over_s``.
    slow: int
    #: Their cached tokens, over all prompt tokens (points of ``hit``).
    slow_hit: float
    #: ``hit - slow_hit``: the hit with the slow requests' tokens counted as uncached.
    hit_without: float


def split(records: Sequence[Served], over_s: float) -> Split:
    """Split a run's hit at ``over_s`` seconds of TTFT (module docstring). A request with no
    first token (shed, failed: its TTFT negative) is not slow."""
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(max(r.cached_tokens, 0) for r in records)
    slow = [r for r in records if r.ttft_s > over_s]
    slow_cached = sum(max(r.cached_tokens, 0) for r in slow)
    if not prompt:
        return Split(over_s=over_s, hit=0.0, slow=len(slow), slow_hit=0.0, hit_without=0.0)
    return Split(over_s=over_s, hit=cached / prompt, slow=len(slow),
                 slow_hit=slow_cached / prompt, hit_without=(cached - slow_cached) / prompt)


HEADER = (f"{'policy':<18} {'hit':>6} {'TTFT over':>9} {'requests':>8} {'their hit':>9} "
          f"{'without':>8}")


def line(policy: str, s: Split) -> str:
    """``s`` as a row of :data:`HEADER`."""
    return (f"{policy:<18} {s.hit:6.1%} {s.over_s:8.1f}s {s.slow:8d} "
            f"{s.slow_hit * 100:6.2f} pt {s.hit_without:8.1%}")


def _thresholds(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--over takes seconds like 1,2.4,5, got {text!r}"
                                         ) from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"--over takes seconds >= 0, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command (module docstring); returns the exit status."""
    from bench.replay import build_parser
    from bench.replay_setup import build_policies, build_sim_config, build_workload
    from bench.sim import simulate

    parser = build_parser("python -m bench.hit_by_wait")
    parser.description = __doc__.splitlines()[0] if __doc__ else None
    parser.add_argument("--over", type=_thresholds, default=DEFAULT_OVER,
                        help="TTFT thresholds in seconds, comma-separated (default 1,2.4,5)")
    parser.set_defaults(policies="kvroute")
    args: Any = parser.parse_args(argv)
    if args.live:
        parser.error("--live is not read here: the policies are simulated")
    try:
        policies = build_policies(args)
    except ValueError as e:
        parser.error(str(e))
    requests, name = build_workload(args, args.seed)
    print(f"{name}, {args.workers} workers x {args.capacity_tokens:,} tokens, "
          f"rate x{args.rate_scale:g}, seed {args.seed}")
    print(HEADER)
    for policy in policies:
        result = simulate(requests, policy, build_sim_config(args, args.event_lag_ms),
                          seed=args.seed)
        for over in args.over:
            print(line(result.policy, split(result.records, over)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
