"""Each ``kvroute`` decision beside the cluster as it really was: where the predicted wait is
wrong, and which holders the rule passes over.

``python -m bench.decision_record --trace FILE --workers 4 --rate-scale 4 --capacity-tokens
300000`` (the workload and cluster flags of :mod:`bench.replay`) simulates the router's rule
once and, at every decision, records each candidate's terms (matched blocks, wait, prefill,
booked prefill blocks) with what the simulated engine had: the prompt's leading blocks it
held, the prefill tokens it still had to compute. It prints:

- **booked against left**: over the candidates with prefill queued, the blocks of prefill the
  router's books held and what the engines had left to compute. The books keep a routed
  prompt's prefill whole until its first token, while the engine works through it.
- **the wait, predicted against delivered**, summed, by whether the chosen worker held the
  prompt's longest prefix (as the router saw it) and by its predicted wait: the delivered wait
  is the TTFT less the prompt's prefill alone on that worker (the timing model's chunks over
  what it held), so it counts the iterations shared with others.
- **holders passed over**: decisions sent to a worker holding fewer blocks than another did,
  how many of them in a busy fleet, their share of the prompt tokens, and how many of those
  holders had more than 1.2 times as much prefill booked as their engine had left.
- **the iteration in flight**: of the decisions whose chosen worker's engine was computing an
  iteration when the request came (it waits for that iteration to end before it is admitted),
  the median time left of it and its median length, and the median TTFT prediction error as
  it is and as it would be had the router known what was left of that iteration (the
  prediction less half the iteration, what a request meets on average, plus what was left).
  The router's books see no iteration; the gap between the two errors is what not knowing
  the iteration's phase costs the prediction.

Run on the trace's last 393 requests at 4x (``docs/experiments.md``, "Where the tail's hits go"),
and on a generator's cell (``--generator multi_turn --workers 4 --rate-scale 8 --requests 800
--seed 202``: ``docs/routing.md``, "The prediction's error").
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.policies.base import RouteRequest
from bench.policies.kvroute_policy import KvroutePolicy
from bench.sim import SimConfig, simulate
from bench.workloads import WorkloadRequest
from router.routing.scheduler import price
from workers.cache.block_keys import Prompt, RequestBlocks

__all__ = ["Candidate", "Decision", "Summary", "main", "record", "report", "summarize"]

#: Predicted-wait bands (seconds) the waits are summed in.
WAIT_BANDS = (0.0, 0.2, 1.0)
#: A holder "booked over" what its engine had left, by this factor.
OVERBOOKED = 1.2


@dataclass(frozen=True, slots=True)
class Candidate:
    """One candidate's terms at a decision, and its engine's state then."""

    matched_blocks: int
    wait_s: float
    prefill_s: float
    booked_blocks: float
    held_blocks: int
    left_blocks: float
    alone_s: float  # the prompt's prefill alone there, in the timing model
    #: What was left of the iteration its engine was computing (0: none in flight).
    in_flight_s: float = 0.0
    #: That iteration's length (0: none in flight).
    iteration_s: float = 0.0


@dataclass(slots=True)
class Decision:
    """One decision: every candidate, the chosen one, and what it delivered."""

    request_id: str
    prompt_tokens: int
    chosen: int
    busy: bool
    candidates: list[Candidate]
    ttft_s: float = -1.0
    #: The chosen worker's predicted time to first token.
    predicted_s: float = 0.0


@dataclass(slots=True)
class Summary:
    """What :func:`summarize` finds (module docstring)."""

    decisions: int = 0
    queued_candidates: int = 0
    booked_blocks: float = 0.0
    left_blocks: float = 0.0
    #: (holds the prefix, band) -> [decisions, predicted wait s, delivered wait s]
    waits: dict[tuple[bool, float], list[float]] = field(default_factory=dict)
    passed_over: int = 0
    passed_over_busy: int = 0
    passed_over_tokens: float = 0.0
    passed_over_overbooked: int = 0
    prompt_tokens: int = 0
    #: Decisions whose chosen worker had an iteration in flight, and the medians over them:
    #: time left of it, its length, the prediction's error, and that error with the time
    #: left known (module docstring).
    in_flight: int = 0
    in_flight_left_s: float = 0.0
    in_flight_iteration_s: float = 0.0
    prediction_error: float = 0.0
    phase_known_error: float = 0.0


class _Recording(KvroutePolicy):
    """The ``kvroute`` policy, recording each decision with the cluster's truth."""

    def __init__(self, config: SimConfig) -> None:
        super().__init__()
        self._config = config
        self.decisions: dict[str, Decision] = {}

    def route(self, request: RouteRequest, now: float) -> int:
        hashes = request.hashes
        index = self.cluster.index
        assert index is not None
        matches = index.match(hashes) if hashes else {}
        core = self.core
        workers = list(range(self.cluster.num_workers))
        candidates = core.candidates(workers, hashes, matches, now)
        costs = {c.worker: c for c in price(len(hashes), candidates).costs}
        engines = self.cluster._workers  # type: ignore[attr-defined]  # the sim's own
        cfg = self._config
        blocks = RequestBlocks(Prompt(tuple(request.token_ids), request.images), cfg.block_size)
        keys = [blocks.block(i).key for i in range((blocks.num_tokens - 1) // cfg.block_size)]
        recorded = []
        for w in workers:
            pool, held = engines[w].cache.pool, 0
            for key in keys:
                if pool.cached_block(key) is None and pool.host_block(key) is None:
                    break
                held += 1
            c, engine = costs[w], engines[w]
            busy = engine.plan is not None
            recorded.append(Candidate(
                c.matched_blocks, c.wait_s, c.prefill_s, c.pending_prefill_blocks, held,
                engine.batcher.pending_prefill_tokens / cfg.block_size,
                _alone_s(cfg, len(request.token_ids), held * cfg.block_size),
                max(0.0, engine.plan_end_s - now) if busy else 0.0,
                engine.plan_end_s - engine.plan_start_s if busy else 0.0))
        worker = super().route(request, now)
        self.decisions[request.request_id] = Decision(
            request.request_id, len(request.token_ids), worker,
            all(c.wait_s > 0 for c in candidates), recorded, predicted_s=costs[worker].cost)
        return worker


def _alone_s(config: SimConfig, tokens: int, cached: int) -> float:
    """Seconds the prompt's prefill takes alone after ``cached`` tokens, in budget chunks."""
    ms, done = 0.0, cached
    while done < tokens:
        chunk = min(config.max_num_batched_tokens, tokens - done)
        ms += config.timing.iteration_ms([(chunk, done)], [])
        done += chunk
    return ms / 1e3


def record(requests: Sequence[WorkloadRequest], config: SimConfig, seed: int = 0
           ) -> list[Decision]:
    """Simulate the router's rule over ``requests`` and return every decision recorded
    (module docstring), in arrival order, with the TTFT each delivered."""
    policy = _Recording(config)
    result = simulate(requests, policy, config, seed=seed)
    out = []
    for rec in result.records:
        decision = policy.decisions[rec.request_id]
        decision.ttft_s = rec.ttft_s
        out.append(decision)
    return out


def _band(wait_s: float) -> float:
    band = WAIT_BANDS[0]
    for edge in WAIT_BANDS:
        if wait_s >= edge and wait_s > 0:
            band = edge
    return band if wait_s > 0 else -1.0


def summarize(decisions: Sequence[Decision], block_size: int = 32) -> Summary:
    """The figures the module docstring lists (``block_size``: tokens a block)."""
    s = Summary(decisions=len(decisions))
    left, iterations, errors, known = [], [], [], []
    for d in decisions:
        s.prompt_tokens += d.prompt_tokens
        for c in d.candidates:
            if c.booked_blocks > 0:
                s.queued_candidates += 1
                s.booked_blocks += c.booked_blocks
                s.left_blocks += c.left_blocks
        top = max(c.matched_blocks for c in d.candidates)
        chosen = d.candidates[d.chosen]
        holds = top > 0 and chosen.matched_blocks == top
        row = s.waits.setdefault((holds, _band(chosen.wait_s)), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += chosen.wait_s
        row[2] += d.ttft_s - chosen.alone_s
        if top > chosen.matched_blocks:
            holder = next(c for c in d.candidates if c.matched_blocks == top)
            s.passed_over += 1
            s.passed_over_busy += d.busy
            s.passed_over_tokens += (top - chosen.matched_blocks) * block_size
            s.passed_over_overbooked += holder.booked_blocks > OVERBOOKED * holder.left_blocks
        if chosen.iteration_s > 0 and d.ttft_s > 0:
            left.append(chosen.in_flight_s)
            iterations.append(chosen.iteration_s)
            errors.append(abs(d.predicted_s - d.ttft_s) / d.ttft_s)
            phased = d.predicted_s - chosen.iteration_s / 2 + chosen.in_flight_s
            known.append(abs(phased - d.ttft_s) / d.ttft_s)
    if left:
        s.in_flight = len(left)
        s.in_flight_left_s = statistics.median(left)
        s.in_flight_iteration_s = statistics.median(iterations)
        s.prediction_error = statistics.median(errors)
        s.phase_known_error = statistics.median(known)
    return s


def report(s: Summary) -> str:
    """The summary as the command prints it."""
    ratio = s.booked_blocks / s.left_blocks if s.left_blocks else float("inf")
    lines = [f"decisions {s.decisions}; candidates with prefill booked {s.queued_candidates}: "
             f"booked {s.booked_blocks:,.0f} blocks, the engines had {s.left_blocks:,.0f} left "
             f"({ratio:.2f}x)",
             "wait of the chosen worker, predicted against delivered (TTFT less its prefill "
             "alone), summed:"]
    labels = {-1.0: "no wait"}
    for lo, hi in zip(WAIT_BANDS, (*WAIT_BANDS[1:], None), strict=True):
        labels[lo] = f"wait {lo:g}-{hi:g} s" if hi is not None else f"wait {lo:g} s or more"
    for (holds, band), (n, predicted, delivered) in sorted(s.waits.items()):
        where = "holds the longest prefix" if holds else "holds less"
        lines.append(f"  {where:24s}  {labels[band]:16s} {int(n):5d} decisions  predicted "
                     f"{predicted:8.2f} s  delivered {delivered:8.2f} s")
    share = s.passed_over_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
    lines.append(f"holders passed over: {s.passed_over} ({s.passed_over_busy} in a busy fleet), "
                 f"{share:.1%} of the prompt tokens; booked over {OVERBOOKED:g}x what the "
                 f"holder's engine had left: {s.passed_over_overbooked}")
    if s.in_flight:
        left_ms, iteration_ms = s.in_flight_left_s * 1e3, s.in_flight_iteration_s * 1e3
        lines.append(f"an iteration in flight on the chosen worker: {s.in_flight} decisions, "
                     f"{left_ms:.1f} ms left of a {iteration_ms:.1f} ms iteration (medians); "
                     f"TTFT prediction error {s.prediction_error:.1%}, "
                     f"{s.phase_known_error:.1%} with what was left of it known")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command (module docstring); returns the exit status."""
    from bench.replay import build_parser
    from bench.replay_setup import build_sim_config, build_workload

    parser = build_parser("python -m bench.decision_record")
    parser.description = __doc__.splitlines()[0] if __doc__ else None
    args: Any = parser.parse_args(argv)
    if args.live or args.router_settings:
        parser.error("--live and --set are not read here: the router's defaults, simulated")
    requests, name = build_workload(args, args.seed)
    config = build_sim_config(args, args.event_lag_ms)
    decisions = record(requests, config, args.seed)
    print(f"{name}, {args.workers} workers x {args.capacity_tokens:,} tokens, "
          f"rate x{args.rate_scale:g}, seed {args.seed}")
    print(report(summarize(decisions, config.block_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
