"""Variants of ``kvroute`` (the router's default,
:class:`~bench.policies.kvroute_pressure.KvrouteAuto`) that change how load is priced: when
a routed request starts to count as decode load, the queue cap, the queue weight under
backlog, the decode term when every worker is full, the overlap weight, and the load a
request imposes on requests that arrive after it (``kvroute_ext*``). Each was measured
against the default and none replaced it; the figures are in ``docs/benchmarks.md``
(sections "Bursts and backlogs", "At the issue's rate" and "The ``multi_turn`` median"). Run
by name only (:data:`LOAD_VARIANTS`, registered in :data:`bench.policies.VARIANTS`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from bench.policies.base import ClusterView, Policy, RouteRequest
from bench.policies.kvroute_pressure import KvrouteAuto, KvroutePressure
from router.pressure import ROUTER_PRESSURE_RULE
from router.scheduler import Candidate

__all__ = ["LOAD_VARIANTS"]

# The backlog and full-cluster variants set the queue weight inside ``candidates``: the base
# route evaluates ``candidates(...)`` before it reads ``self.config`` for ``choose``, and
# ``KvroutePressure.route`` sets the pressure's weight again before the next decision.


class KvrouteWaiting(KvrouteAuto):
    """Variant of ``kvroute``: a request routed but not yet at its first token counts in the
    worker's decode term from the moment it is routed (as Dynamo's active blocks do), not
    only after its first token, so a burst that arrives before any first token still sees
    the decode load it is about to add."""

    name = "kvroute_waiting"
    waiting_share = 1.0

    def candidates(self, hashes: list[int], now: float) -> list[Candidate]:
        return [dataclasses.replace(
            c, decode_blocks=c.decode_blocks
            + self.waiting_share * self._load.waiting_blocks(c.worker))
            for c in super().candidates(hashes, now)]


class KvrouteWaitingHalf(KvrouteWaiting):
    """Variant: as ``kvroute_waiting`` with waiting requests' blocks at half weight."""

    name = "kvroute_waiting_half"
    waiting_share = 0.5


class KvrouteNoCap(KvrouteAuto):
    """Variant of ``kvroute`` without the queue cap (what the cap buys: the 8 x 0.5M trace
    p99, ``docs/benchmarks.md``)."""

    name = "kvroute_nocap"

    def __init__(self) -> None:
        KvroutePressure.__init__(self, rule=ROUTER_PRESSURE_RULE, queue_cap_blocks=float("inf"))


class KvrouteBacklog(KvrouteAuto):
    """Variant of ``kvroute``: while every worker has at least ``backlog_blocks`` of prefill
    queued (the cluster is saturated: a recompute adds to a backlog everyone waits on), the
    queue weight drops to ``backlog_weight`` whatever the pressure says."""

    name = "kvroute_backlog256"
    backlog_blocks = 256.0
    backlog_weight = 0.1

    def candidates(self, hashes: list[int], now: float) -> list[Candidate]:
        out = super().candidates(hashes, now)
        if min(c.pending_prefill_blocks for c in out) >= self.backlog_blocks \
                and self.config.queue_weight > self.backlog_weight:
            self.config = dataclasses.replace(self.config, queue_weight=self.backlog_weight)
        return out


class KvrouteBacklog1000(KvrouteBacklog):
    """Variant: as ``kvroute_backlog256`` from 1,000 queued blocks on every worker."""

    name = "kvroute_backlog1000"
    backlog_blocks = 1000.0


class KvrouteFullNoDecode(KvrouteAuto):
    """Variant of ``kvroute``: while every worker is at its sequence limit (all admit only as
    requests finish), the decode term is left out: each runs a full batch either way."""

    name = "kvroute_full_nodecode"
    full_queue_weight: float | None = None

    def candidates(self, hashes: list[int], now: float) -> list[Candidate]:
        out = super().candidates(hashes, now)
        limit = self.cluster.max_num_seqs
        if limit and all(c.active_requests >= limit for c in out):
            out = [dataclasses.replace(c, decode_blocks=0.0) for c in out]
            if self.full_queue_weight is not None:
                self.config = dataclasses.replace(self.config,
                                                  queue_weight=self.full_queue_weight)
        return out


class KvrouteFullSticky(KvrouteFullNoDecode):
    """Variant: as ``kvroute_full_nodecode``, and queue weight 0 while all are full (only
    the part of a queue past the cap counts)."""

    name = "kvroute_full_sticky"
    full_queue_weight = 0.0


class KvrouteOverlap16(KvrouteAuto):
    """Variant of ``kvroute`` with overlap weight 16 (a decoding block priced at 1/16 of a
    prefill block, not 1/32)."""

    name = "kvroute_ow16"
    overlap_weight = 16.0

    def __init__(self) -> None:
        super().__init__()
        self.config = dataclasses.replace(self.config, overlap_weight=self.overlap_weight)


class KvrouteOverlap8(KvrouteOverlap16):
    """Variant of ``kvroute`` with overlap weight 8."""

    name = "kvroute_ow8"
    overlap_weight = 8.0


class KvrouteOverlap64(KvrouteOverlap16):
    """Variant of ``kvroute`` with overlap weight 64."""

    name = "kvroute_ow64"
    overlap_weight = 64.0


class KvrouteIterations(KvrouteAuto):
    """Variant of ``kvroute``: the decode term counted once per engine iteration the request
    would wait through (``1 + pending prefill / 256`` blocks, 256 blocks being one 8,192-token
    iteration): a TTFT-shaped price for a worker's decode batch."""

    name = "kvroute_iter"

    def candidates(self, hashes: list[int], now: float) -> list[Candidate]:
        return [dataclasses.replace(
            c, decode_blocks=c.decode_blocks * (1.0 + c.pending_prefill_blocks / 256.0))
            for c in super().candidates(hashes, now)]


class KvrouteExternality(KvrouteAuto):
    """Variant of ``kvroute``: each worker's decode term also counts the decode blocks this
    request would add to the batch of every request arriving there while it decodes,
    ``horizon_s * B * rate(w)``, with ``rate(w)`` the requests routed to ``w`` over the last
    ``window_s`` seconds. The request's own TTFT grows with a worker's decode batch; this is
    the TTFT it costs the requests after it, so a long prompt avoids a busy lane and short
    prompts gather where the batch is light (shortest-job lanes)."""

    name = "kvroute_ext15"
    horizon_s = 15.0
    window_s = 10.0

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        self._routed: list[deque[float]] = [deque() for _ in range(cluster.num_workers)]

    def rate(self, worker: int, now: float) -> float:
        """Requests per second routed to ``worker`` over the last ``window_s``."""
        times = self._routed[worker]
        while times and times[0] < now - self.window_s:
            times.popleft()
        return len(times) / self.window_s

    def candidates(self, hashes: list[int], now: float) -> list[Candidate]:
        extra = self.horizon_s * len(hashes)
        return [dataclasses.replace(
            c, decode_blocks=c.decode_blocks + extra * self.rate(c.worker, now))
            for c in super().candidates(hashes, now)]

    def route(self, request: RouteRequest, now: float) -> int:
        worker = super().route(request, now)
        self._routed[worker].append(now)
        return worker


class KvrouteExternality20(KvrouteExternality):
    """Variant: as ``kvroute_ext15`` with a 20 s horizon."""

    name = "kvroute_ext20"
    horizon_s = 20.0


class KvrouteLanes(KvrouteAuto):
    """Variant of ``kvroute``: deliberate light and heavy lanes. The first ``5/8`` of the
    workers (rounded down) are balanced to ``light_share`` of the mean decode load and the rest
    take what is left: each worker's decode term is divided by its share, so the scheduler
    equalises ``decode_blocks / share``. llm-d's lower ``multi_turn`` median comes from a skew
    like this one, formed by accident; this variant forms it on purpose, to measure what the
    median costs in the tail."""

    name = "kvroute_lanes70"
    light_share = 0.7

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        n = cluster.num_workers
        light = n * 5 // 8
        heavy = (n - self.light_share * light) / (n - light) if n > light else 1.0
        self._shares = [self.light_share] * light + [heavy] * (n - light)

    def candidates(self, hashes: list[int], now: float) -> list[Candidate]:
        return [dataclasses.replace(c, decode_blocks=c.decode_blocks / self._shares[c.worker])
                for c in super().candidates(hashes, now)]


class KvrouteLanes80(KvrouteLanes):
    """Variant: as ``kvroute_lanes70`` with the light lanes at 0.8 of the mean."""

    name = "kvroute_lanes80"
    light_share = 0.8


#: name -> class, for :data:`bench.policies.VARIANTS`.
LOAD_VARIANTS: dict[str, Callable[[], Policy]] = {
    "kvroute_waiting": KvrouteWaiting,
    "kvroute_waiting_half": KvrouteWaitingHalf,
    "kvroute_nocap": KvrouteNoCap,
    "kvroute_backlog256": KvrouteBacklog,
    "kvroute_backlog1000": KvrouteBacklog1000,
    "kvroute_full_nodecode": KvrouteFullNoDecode,
    "kvroute_full_sticky": KvrouteFullSticky,
    "kvroute_ow8": KvrouteOverlap8,
    "kvroute_ow16": KvrouteOverlap16,
    "kvroute_ow64": KvrouteOverlap64,
    "kvroute_iter": KvrouteIterations,
    "kvroute_ext15": KvrouteExternality,
    "kvroute_ext20": KvrouteExternality20,
    "kvroute_lanes70": KvrouteLanes,
    "kvroute_lanes80": KvrouteLanes80,
}
