"""Routing policies for the benchmark: one interface (:mod:`.base`), one file per policy.

:data:`POLICIES` maps each name to a factory of a fresh policy with its documented defaults.
Besides those names, ``kvroute[NAME=VALUE,...]`` runs the router's core with router settings
changed (:class:`router.settings.RouterSettings` field names, the values as a flag takes
them), e.g. ``kvroute[learn_rates=off]`` or ``kvroute[policy=dynamo]``.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.policies.base import ClusterView, Policy, RouteRequest, WorkerMetrics
from bench.policies.dynamo import Dynamo
from bench.policies.kvroute_policy import KvroutePolicy
from bench.policies.least_loaded import LeastLoaded
from bench.policies.llmd_precise import LlmdPrecise
from bench.policies.random_policy import RandomPolicy
from bench.policies.round_robin import RoundRobin
from bench.policies.sglang_cache_aware import SglangCacheAware
from router.settings import SettingsError, load_settings

__all__ = [
    "POLICIES",
    "ClusterView",
    "Dynamo",
    "KvroutePolicy",
    "LeastLoaded",
    "LlmdPrecise",
    "Policy",
    "RandomPolicy",
    "RoundRobin",
    "RouteRequest",
    "SglangCacheAware",
    "WorkerMetrics",
    "kvroute_with",
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
    "kvroute": KvroutePolicy,
}


def kvroute_with(name: str) -> KvroutePolicy:
    """The ``kvroute`` policy a name ``kvroute[NAME=VALUE,...]`` asks for.

    Raises:
        ValueError: not of that form, an unknown setting, or a bad value.
    """
    if not (name.startswith("kvroute[") and name.endswith("]")):
        raise ValueError(f"{name!r} is not kvroute[NAME=VALUE,...]")
    flags: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in name[8:-1].split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} in {name!r} is not NAME=VALUE")
        flags[key.strip()] = value.strip()
    known = set(load_settings({}, env={}).__dataclass_fields__)
    unknown = sorted(set(flags) - known)
    if unknown:
        raise ValueError(f"{name!r}: unknown router settings {unknown}")
    try:
        settings = load_settings(flags, env={})
    except SettingsError as exc:
        raise ValueError(f"{name!r}: {exc}") from None
    return KvroutePolicy(settings, name)


def _split(names: str) -> list[str]:
    """Split a comma-separated list of names, keeping commas inside brackets."""
    out, depth, current = [], 0, ""
    for ch in names:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    out.append(current.strip())
    return [n for n in out if n]


def make_policies(names: str) -> list[Policy]:
    """Return fresh policies for a comma-separated list of names, or ``"all"``.

    Raises:
        ValueError: an unknown name.
    """
    wanted = list(POLICIES) if names.strip() == "all" else _split(names)
    unknown = [n for n in wanted if n not in POLICIES and not n.startswith("kvroute[")]
    if unknown or not wanted:
        raise ValueError(f"unknown policies {unknown}; choose from {list(POLICIES)}, "
                         "kvroute[NAME=VALUE,...] or 'all'")
    return [POLICIES[n]() if n in POLICIES else kvroute_with(n) for n in wanted]
