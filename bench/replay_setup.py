"""What a trace replay runs, built from its parsed arguments (:func:`bench.replay.build_parser`):
the workload, fresh policies with ``--set`` applied, the simulated cluster's configuration and
``--set``'s router settings. :mod:`bench.replay` and the benchmarks built on its arguments
(``capacity``, ``decision_record``, ``hit_by_wait``, ``topology``, ``topology_live``) share
these.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.engine.timing import TIMING_MODELS

__all__ = ["build_policies", "build_sim_config", "build_workload", "parse_router_changes"]


def build_workload(args: argparse.Namespace, seed: int) -> tuple[list[Any], str]:
    """The requests of ``--trace`` or ``--generator`` (drawn at ``seed``), scaled by
    ``--rate-scale``, and the workload's name."""
    from bench.workloads import DEFAULT_TRACE, GeneratorConfig, generate, load_trace, scale_rate

    if args.generator == "trace":
        path = Path(args.trace) if args.trace else DEFAULT_TRACE
        requests = load_trace(path, limit=args.requests)
        name = path.name
    else:
        config = GeneratorConfig(requests=args.requests or 2000, rate=args.rate)
        requests = generate(args.generator, config, seed=seed)
        name = args.generator
    return scale_rate(requests, args.rate_scale), name


def parse_router_changes(items: Sequence[str]) -> dict[str, Any]:
    """``--set NAME=VALUE`` items as typed router settings.

    Raises:
        ValueError: not NAME=VALUE, an unknown setting, or a bad value.
    """
    from router.settings import RouterSettings, SettingsError, load_settings

    flags: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in RouterSettings.__dataclass_fields__:
            raise ValueError(f"--set {item!r}: not NAME=VALUE with NAME a router setting")
        flags[name] = value.strip()
    try:
        settings = load_settings(flags, env={})
    except SettingsError as exc:
        raise ValueError(f"--set: {exc}") from None
    return {name: getattr(settings, name) for name in flags}


def build_policies(args: argparse.Namespace, names: str | None = None) -> list[Any]:
    """Fresh policies for ``names`` (default ``--policies``), with ``--set`` applied to every
    kvroute policy."""
    from bench.policies import KvroutePolicy, make_policies

    # The router is told the simulated link, as an operator sets --pd-kv-bytes-per-token
    # and --pd-transfer-bandwidth for theirs; --set may still change either.
    link = {"pd_kv_bytes_per_token": TIMING_MODELS[args.timing].kv_bytes_per_token,
            "pd_transfer_bandwidth": args.kv_transfer_bandwidth}
    changes = link | parse_router_changes(args.router_settings)
    policies = make_policies(args.policies if names is None else names)
    for i, p in enumerate(policies):
        if isinstance(p, KvroutePolicy):
            policies[i] = p.with_settings(**changes)
    return policies


def build_sim_config(args: argparse.Namespace, lag_ms: float) -> Any:
    """The simulated cluster (:class:`bench.sim.SimConfig`) with events ``lag_ms`` late."""
    from bench.sim import SimConfig

    return SimConfig(workers=args.workers, capacity_tokens=args.capacity_tokens,
                     block_size=args.block_size, event_lag_s=lag_ms / 1e3,
                     event_path=args.event_path,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     timing=TIMING_MODELS[args.timing],
                     kv_transfer_bytes_per_s=args.kv_transfer_bandwidth,
                     peer_fetch=getattr(args, "peer_fetch", False))
