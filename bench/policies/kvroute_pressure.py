"""``kvroute_pressure``: the ``kvroute`` policy with the eviction-pressure queue weight.

Everything as :class:`~bench.policies.kvroute_policy.KvroutePolicy` (index, predicted
residency, load books, :func:`router.scheduler.choose`), except the scheduler's queue weight,
which follows the cluster's eviction pressure (:mod:`router.pressure`) at each decision:
0.25 at pressure <= 0.3, 0.10 at >= 0.7, linear between; and only the first
``queue_cap_blocks`` (3,000) of a worker's pending prefill are weighted at it, the rest at
1.0. The pressure tracker is fed the same normalised events the index applies
(:meth:`~bench.policies.base.Policy.index_events`), when the index applies them: what a
router's event subscriber would hand it.

:attr:`KvroutePressure.pressure_samples` keeps the pressure seen at each decision, for
reporting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from bench.policies.base import ClusterView, RouteRequest
from bench.policies.kvroute_policy import KvroutePolicy
from indexer.events import Event
from router.pressure import (
    ROUTER_PRESSURE_RULE,
    EvictionPressure,
    PressureRule,
    queue_terms_for,
    queue_weight_for,
)
from router.scheduler import Candidate, SchedulerConfig
from router.settings import RouterSettings

__all__ = ["KvroutePressure"]


class KvroutePressure(KvroutePolicy):
    """``kvroute`` with the queue weight set by eviction pressure (module docstring).

    Args:
        config: scheduler settings other than the queue weight (the router's defaults when
            omitted); its ``queue_cap_blocks`` is replaced by ``queue_cap_blocks``.
        predict_ttl: as :class:`KvroutePolicy`.
        rule: the pressure -> queue weight mapping (:class:`router.pressure.PressureRule`'s
            defaults when omitted).
        queue_cap_blocks: pending-prefill blocks per worker weighted at the queue weight.
        window_s: the pressure's removal window, seconds.
    """

    name = "kvroute_pressure"

    def __init__(self, config: SchedulerConfig | None = None, predict_ttl: float | None = None,
                 rule: PressureRule | None = None, queue_cap_blocks: float = 3000.0,
                 window_s: float = 10.0) -> None:
        base = config or RouterSettings().scheduler_config()
        super().__init__(dataclasses.replace(base, queue_cap_blocks=queue_cap_blocks),
                         predict_ttl)
        self.rule = rule or PressureRule()
        self.window_s = window_s

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        self._pressure = EvictionPressure(self.window_s)
        self.pressure_samples: list[float] = []

    def index_events(self, worker: int, events: Sequence[Event], now: float) -> None:
        self._pressure.observe(worker, events, now)

    def route(self, request: RouteRequest, now: float) -> int:
        pressure = self._pressure.pressure(now)
        self.pressure_samples.append(pressure)
        warming = self.rule.warmup_weight is not None and self._pressure.warming(
            self.cluster.capacity_blocks * self.cluster.num_workers, self.rule.warmup_fill)
        weight, cached_only = queue_terms_for(pressure, self.rule, warming=warming)
        if (weight, cached_only) != (self.config.queue_weight,
                                     self.config.queue_discount_cached_only):
            self.config = dataclasses.replace(self.config, queue_weight=weight,
                                              queue_discount_cached_only=cached_only)
        return super().route(request, now)


class KvroutePressureCap1500(KvroutePressure):
    """Variant: only the first 1,500 pending-prefill blocks weighted at the queue weight."""

    name = "kvroute_pressure_cap1500"

    def __init__(self) -> None:
        super().__init__(queue_cap_blocks=1500.0)


class KvroutePressureSmooth(KvroutePressure):
    """Variant: removals over 30 s (thresholds x3: the same rate, smoothed)."""

    name = "kvroute_pressure_smooth"

    def __init__(self) -> None:
        super().__init__(rule=PressureRule(low=0.9, high=2.1), window_s=30.0)


class KvroutePressureHalf(KvroutePressure):
    """Variant: today's queue weight (0.5) at low pressure, down to 0.10 at high pressure."""

    name = "kvroute_pressure_half"

    def __init__(self) -> None:
        super().__init__(rule=PressureRule(low_pressure_weight=0.5))


class KvroutePressureIdle(KvroutePressure):
    """Variant: the rule's weights wherever caches evict, today's 0.5 where they do not (0.5 at
    pressure 0, linear to 0.25 at 0.1, then as ``kvroute_pressure``)."""

    name = "kvroute_pressure_idle"

    def __init__(self) -> None:
        super().__init__(rule=PressureRule(idle_weight=0.5, idle_below=0.1))


class KvroutePressureBalanced(KvroutePressure):
    """Variant: as ``kvroute_pressure_idle``, with the overlap weight scaled by 0.5 / queue
    weight, so ``overlap_weight * queue_weight`` (what a queued block costs against a decoding
    one) stays today's 16 and only the recompute-against-wait trade moves with pressure."""

    name = "kvroute_pressure_balanced"

    def __init__(self) -> None:
        super().__init__(rule=PressureRule(idle_weight=0.5, idle_below=0.1))
        self._queue_price = self.config.overlap_weight * 0.5

    def route(self, request: RouteRequest, now: float) -> int:
        weight = queue_weight_for(self._pressure.pressure(now), self.rule)
        overlap = self._queue_price / weight if weight > 0 else self.config.overlap_weight
        if overlap != self.config.overlap_weight:
            self.config = dataclasses.replace(self.config, overlap_weight=overlap)
        return super().route(request, now)


class KvroutePressureAdmit(KvroutePressure):
    """``kvroute_pressure`` plus the scheduler's admission term
    (:func:`router.scheduler.admission_blocks`): a worker is charged the blocks that must
    finish there before the request could be admitted.

    Candidates are :meth:`KvroutePolicy.candidates`' plus what the admission term reads, as a
    router would fill them: ``kv_held_blocks`` from the load books (decode blocks plus
    :meth:`router.load.LoadTracker.waiting_blocks`) or, with ``distinct``, the distinct blocks
    of the prompts in flight there (and ``kv_shared_blocks`` the request's blocks among them);
    ``kv_capacity_blocks`` the pressure tracker's peak resident blocks
    (:meth:`router.pressure.EvictionPressure.peak`; 0 until the worker's events say anything)
    or, with ``capacity="model_info"``, the worker's device blocks as its ``/model_info``
    reports them; ``max_running`` the engine's ``max_num_seqs`` as ``/model_info`` reports it
    (256, the simulation's default).

    Args:
        admission_weight: the term's weight (:attr:`SchedulerConfig.admission_weight`).
        kv: charge KV excess; False leaves the capacity unknown (no KV term).
        max_running: the workers' sequence limit; 0 leaves it unknown (no slot term).
        distinct: estimate held KV as distinct in-flight prompt blocks, not the books' sum.
        capacity: ``"peak"`` or ``"model_info"`` (module docstring above).
        rule, queue_cap_blocks: as :class:`KvroutePressure`.
    """

    name = "kvroute_pressure_admit"

    def __init__(self, admission_weight: float = 1.0, kv: bool = True, max_running: int = 256,
                 distinct: bool = False, capacity: str = "peak",
                 rule: PressureRule | None = None, queue_cap_blocks: float = 3000.0) -> None:
        super().__init__(RouterSettings().scheduler_config(admission_weight=admission_weight),
                         rule=rule, queue_cap_blocks=queue_cap_blocks)
        if capacity not in ("peak", "model_info"):
            raise ValueError(f"capacity must be 'peak' or 'model_info', got {capacity!r}")
        self.kv = kv
        self.max_running = max_running
        self.distinct = distinct
        self.capacity = capacity

    def start(self, cluster: ClusterView) -> None:
        super().start(cluster)
        self._held: list[dict[int, int]] = [{} for _ in range(cluster.num_workers)]
        self._prompts: dict[str, tuple[int, list[int]]] = {}

    def _capacity(self, worker: int) -> float:
        if not self.kv:
            return 0.0
        if self.capacity == "peak":
            return float(self._pressure.peak(worker))
        # what /model_info's capacity.num_blocks says; the simulation's cache is that engine's
        return float(self.cluster._workers[worker].cache.pool.num_blocks)  # type: ignore[attr-defined]

    def candidates(self, hashes: list[int], now: float) -> list[Candidate]:
        out = []
        for c in super().candidates(hashes, now):
            w = c.worker
            if self.distinct:
                held_map = self._held[w]
                held = float(len(held_map))
                shared = float(sum(1 for h in hashes if h in held_map))
            else:
                held = c.decode_blocks + self._load.waiting_blocks(w)
                shared = 0.0
            out.append(dataclasses.replace(
                c, kv_held_blocks=held, kv_shared_blocks=shared,
                kv_capacity_blocks=self._capacity(w), max_running=self.max_running))
        return out

    def route(self, request: RouteRequest, now: float) -> int:
        worker = super().route(request, now)
        if self.distinct:
            held_map = self._held[worker]
            for h in request.hashes:
                held_map[h] = held_map.get(h, 0) + 1
            self._prompts[request.request_id] = (worker, request.hashes)
        return worker

    def finished(self, request_id: str, now: float) -> None:
        super().finished(request_id, now)
        entry = self._prompts.pop(request_id, None)
        if entry is not None:
            held_map = self._held[entry[0]]
            for h in entry[1]:
                n = held_map[h] - 1
                if n:
                    held_map[h] = n
                else:
                    del held_map[h]


def _admit_variant(name: str, doc: str, **kwargs: object) -> type[KvroutePressureAdmit]:
    def __init__(self: KvroutePressureAdmit) -> None:
        KvroutePressureAdmit.__init__(self, **kwargs)  # type: ignore[arg-type]

    return type(_camel(name), (KvroutePressureAdmit,),
                {"name": name, "__init__": __init__, "__doc__": doc})


def _camel(name: str) -> str:
    return "".join(part.title() for part in name.split("_"))


#: Today's fixed queue weight (0.5, no cap) as a pressure rule, for the ``kvroute_admit*``
#: variants.
FIXED_HALF = PressureRule(low_pressure_weight=0.5, high_pressure_weight=0.5)

#: Admission variants, name -> class (registered in :data:`bench.policies.VARIANTS`).
ADMIT_VARIANTS: dict[str, type[KvroutePressureAdmit]] = {
    "kvroute_pressure_admit": KvroutePressureAdmit,
    **{n: _admit_variant(n, d, **kw) for n, d, kw in [
        ("kvroute_pressure_admit_kv", "K + KV-excess term only (weight 1).",
         {"max_running": 0}),
        ("kvroute_pressure_admit_seq", "K + sequence-slot term only (weight 1).",
         {"kv": False}),
        ("kvroute_pressure_admit_seq025", "K + sequence-slot term only (weight 0.25).",
         {"kv": False, "admission_weight": 0.25}),
        ("kvroute_pressure_admit_seq4", "K + sequence-slot term only (weight 4).",
         {"kv": False, "admission_weight": 4.0}),
        ("kvroute_pressure_admit_distinct",
         "K + slot term + KV term over distinct in-flight blocks, /model_info capacity (1).",
         {"distinct": True, "capacity": "model_info"}),
        ("kvroute_pressure_admit_distinct_peak",
         "K + slot term + KV term over distinct in-flight blocks, peak capacity (weight 1).",
         {"distinct": True}),
        ("kvroute_admit", "Today's fixed queue weight 0.5 + both admission terms (weight 1).",
         {"rule": FIXED_HALF, "queue_cap_blocks": float("inf")}),
        ("kvroute_admit_seq", "Today's fixed queue weight 0.5 + slot term only (weight 1).",
         {"rule": FIXED_HALF, "queue_cap_blocks": float("inf"), "kv": False}),
    ]},
}


#: ``--queue-weight auto`` until the eleventh session: 0.5 on the whole queue (up to the cap)
#: while the caches warm up, without ``warmup_cached_only``. The variants measured before then
#: keep it, so their figures in ``docs/benchmarks.md`` still print.
WHOLE_QUEUE_RULE = PressureRule(warmup_weight=0.5, warmup_fill=0.5)


class KvrouteAuto(KvroutePressure):
    """``kvroute``: the router's default, ``--queue-weight auto``
    (:data:`router.pressure.ROUTER_PRESSURE_RULE`): 0.5 while the caches warm up (no eviction
    yet, under half full), discounting each queue only up to the request's cached blocks
    there, rule K after, the first 3,000 queued blocks discounted, and the admission term's
    slot half. Measured first as ``kvroute_pressure_fill``; ``kvroute_pressure_filled`` was
    the same without the fill test (0.5 until the first eviction)."""

    name = "kvroute"

    def __init__(self) -> None:
        super().__init__(rule=ROUTER_PRESSURE_RULE)


class KvrouteNoSessions(KvroutePressure):
    """``kvroute`` without sessions (``--session-weight 0 --session-queue-blocks off``) and
    with the whole queue discounted while warming up: the router's default until the tenth
    session, for the figures measured before it."""

    name = "kvroute_nosessions"

    def __init__(self) -> None:
        super().__init__(dataclasses.replace(RouterSettings().scheduler_config(),
                                             session_weight=0.0),
                         rule=WHOLE_QUEUE_RULE)


class KvrouteWholeQueue(KvroutePressure):
    """``kvroute`` with the whole queue discounted while the caches warm up (no
    ``warmup_cached_only``): the router's default of the tenth session."""

    name = "kvroute_wholequeue"

    def __init__(self) -> None:
        super().__init__(rule=WHOLE_QUEUE_RULE)
