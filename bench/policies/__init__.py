"""Routing policies for the benchmark: one interface (:mod:`.base`), one file per policy.

:data:`POLICIES` maps each name to a factory of a fresh policy with its documented defaults;
:data:`VARIANTS` holds experimental variants, run by name, never by ``all``.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.policies.base import ClusterView, Policy, RouteRequest, WorkerMetrics
from bench.policies.dynamo import Dynamo
from bench.policies.kvroute_affinity import KvrouteAffinity, KvrouteAffinity1
from bench.policies.kvroute_load_variants import LOAD_VARIANTS
from bench.policies.kvroute_policy import KvroutePolicy, KvrouteUntuned
from bench.policies.kvroute_pressure import (
    ADMIT_VARIANTS,
    KvrouteAuto,
    KvrouteNoSessions,
    KvroutePressure,
    KvroutePressureBalanced,
    KvroutePressureCap1500,
    KvroutePressureHalf,
    KvroutePressureIdle,
    KvroutePressureSmooth,
    KvrouteWholeQueue,
)
from bench.policies.least_loaded import LeastLoaded
from bench.policies.llmd_precise import LlmdPrecise
from bench.policies.random_policy import RandomPolicy
from bench.policies.round_robin import RoundRobin
from bench.policies.sglang_cache_aware import SglangCacheAware

__all__ = [
    "POLICIES",
    "VARIANTS",
    "ClusterView",
    "Dynamo",
    "KvroutePolicy",
    "KvroutePressure",
    "KvrouteUntuned",
    "LeastLoaded",
    "LlmdPrecise",
    "Policy",
    "RandomPolicy",
    "RoundRobin",
    "RouteRequest",
    "SglangCacheAware",
    "WorkerMetrics",
    "make_policies",
]

#: Policy name -> factory, in the order reports list them.
POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "random": RandomPolicy,
    "least_loaded": LeastLoaded,
    "sglang_cache_aware": SglangCacheAware,
    "llmd_precise": LlmdPrecise,
    "dynamo": Dynamo,
    "kvroute": KvrouteAuto,
    "kvroute_fixed": KvroutePolicy,
    "kvroute_untuned": KvrouteUntuned,
    "kvroute_pressure": KvroutePressure,
}

#: Variants run by name only (not in ``all``): experiments around ``kvroute_pressure``.
VARIANTS: dict[str, Callable[[], Policy]] = {
    "kvroute_pressure_cap1500": KvroutePressureCap1500,
    "kvroute_pressure_smooth": KvroutePressureSmooth,
    "kvroute_pressure_half": KvroutePressureHalf,
    "kvroute_pressure_idle": KvroutePressureIdle,
    "kvroute_pressure_balanced": KvroutePressureBalanced,
    **ADMIT_VARIANTS,
    **LOAD_VARIANTS,
    "kvroute_affinity4": KvrouteAffinity,
    "kvroute_affinity1": KvrouteAffinity1,
    "kvroute_nosessions": KvrouteNoSessions,
    "kvroute_wholequeue": KvrouteWholeQueue,
}


def make_policies(names: str) -> list[Policy]:
    """Return fresh policies for a comma-separated list of names, or ``"all"``.

    Raises:
        ValueError: an unknown name.
    """
    wanted = list(POLICIES) if names.strip() == "all" else [
        n.strip() for n in names.split(",") if n.strip()]
    known = {**POLICIES, **VARIANTS}
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise ValueError(f"unknown policies {unknown}; choose from {list(known)} or 'all'")
    return [known[n]() for n in wanted]
