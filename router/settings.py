"""Router settings: read once at start-up from flags, environment and a config file, then
frozen and passed down (starlette's ``config.py`` is the model).

Precedence: command-line flag > environment (``KVROUTE_*``) > config file (TOML or JSON,
``--config``) > default. Every bad value is refused with a message naming where it came from.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from router.scheduler import SchedulerConfig
from router.worker_config import format_worker, parse_workers

__all__ = ["POLICIES", "RouterSettings", "SettingsError", "load_settings"]

#: ``kv``: prefix hits weighed against load (the point of kvroute). ``round_robin`` and
#: ``random`` ignore the cache: baselines to measure against, one flag away.
POLICIES = ("kv", "round_robin", "random")


class SettingsError(ValueError):
    """A setting is missing, malformed or out of range; the message says which and where."""


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything the router needs to know at start-up."""

    host: str = "127.0.0.1"
    port: int = 8000
    #: Each worker in its flat text form: ``URL[,engine=...,events=...]`` (router.worker_config).
    workers: tuple[str, ...] = ()
    block_size: int = 32
    tokenizer: str | None = None
    overlap_weight: float = 32.0
    queue_weight: float | None = None
    queue_cap_blocks: float | None = None
    admission_weight: float = 1.0
    affinity_weight: float = 4.0
    affinity_lead_blocks: int = 8
    session_weight: float = 16.0
    session_queue_blocks: float | None = 128.0
    pressure_window: float = 10.0
    host_credit: float = 0.75
    temperature: float = 0.0
    policy: str = "kv"
    predict_ttl: float = 10.0
    approximate_ttl: float = 120.0
    health_interval: float = 1.0
    unhealthy_grace: float = 5.0
    connect_timeout: float = 2.0
    first_byte_timeout: float = 300.0
    max_image_bytes: int = 20 * 1024 * 1024
    admin_token: str | None = None
    worker_admin_token: str | None = None
    seed: int | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        checks = [
            (0 < self.port < 65536, f"port {self.port} is not in 1..65535"),
            (self.block_size > 0, f"block_size {self.block_size} must be positive"),
            (self.overlap_weight >= 0, "overlap_weight must be >= 0"),
            (self.queue_weight is None or self.queue_weight >= 0,
             "queue_weight must be >= 0 (or auto: by eviction pressure)"),
            (self.queue_cap_blocks is None or self.queue_cap_blocks >= 0,
             "queue_cap_blocks must be >= 0"),
            (self.pressure_window > 0, "pressure_window must be positive"),
            (self.admission_weight >= 0, "admission_weight must be >= 0"),
            (self.affinity_weight > 0, "affinity_weight must be > 0 (1 = no change)"),
            (self.affinity_lead_blocks >= 1, "affinity_lead_blocks must be >= 1"),
            (self.session_weight >= 0, "session_weight must be >= 0 (0 = no session term)"),
            (self.session_queue_blocks is None or self.session_queue_blocks >= 0,
             "session_queue_blocks must be >= 0 (or off: continuations are not kept home)"),
            (0 <= self.host_credit <= 1, "host_credit must be in [0, 1]"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.policy in POLICIES,
             f"policy {self.policy!r} is not one of {', '.join(POLICIES)}"),
            (self.predict_ttl > 0 and self.approximate_ttl > 0, "ttls must be positive"),
            (self.health_interval > 0, "health_interval must be positive"),
            (self.unhealthy_grace >= 0, "unhealthy_grace must be >= 0"),
            (self.connect_timeout > 0 and self.first_byte_timeout > 0,
             "timeouts must be positive"),
            (self.max_image_bytes > 0, "max_image_bytes must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)
        try:  # each entry is a worker's flat text form (router.worker_config)
            parse_workers(list(self.workers))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None

    @property
    def sessions(self) -> bool:
        """Whether the router tracks sessions (either session setting is on)."""
        return self.session_weight > 0 or self.session_queue_blocks is not None

    def scheduler_config(self, **changes: float) -> SchedulerConfig:
        """The scheduler settings these settings give (the queue weight and cap are the
        scheduler's defaults unless ``changes`` set them: the service derives them from
        ``queue_weight`` and ``queue_cap_blocks``, which may be ``auto``)."""
        fields_ = {"overlap_weight": self.overlap_weight, "host_credit": self.host_credit,
                   "temperature": self.temperature, "admission_weight": self.admission_weight,
                   "affinity_weight": self.affinity_weight,
                   "affinity_lead_blocks": self.affinity_lead_blocks,
                   "session_weight": self.session_weight, **changes}
        if self.session_queue_blocks is not None:
            fields_.setdefault("session_queue_blocks", self.session_queue_blocks)
        return SchedulerConfig(**fields_)  # type: ignore[arg-type]


_TYPES = {f.name: f.type for f in fields(RouterSettings)}
#: The words an optional number takes for "none": ``auto`` where the router then derives it
#: (the default), ``off`` where none means the feature is off.
_NONE_WORDS = {"session_queue_blocks": ("off", "none", "")}


def _coerce(name: str, value: Any, origin: str) -> Any:
    kind = _TYPES[name]
    try:
        if name == "workers":
            return tuple(format_worker(w) for w in parse_workers(value))
        if value is None:
            return None
        if kind in ("int", "int | None"):
            return int(value)
        if kind == "float | None" and str(value).strip().lower() in _NONE_WORDS.get(
                name, ("auto", "none", "")):
            return None
        if kind in ("float", "float | None"):
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        if name == "workers":
            raise SettingsError(f"workers from {origin}: {exc}") from None
        raise SettingsError(f"{name} from {origin}: {value!r} is not a valid {kind}") from None


def _read_file(path: str) -> dict[str, Any]:
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise SettingsError(f"config file {path}: {exc.strerror}") from None
    try:
        data = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"config file {path} is not valid: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a table of settings")
    data = data.get("router", data)
    unknown = set(data) - set(_TYPES)
    if unknown:
        raise SettingsError(f"config file {path}: unknown settings {sorted(unknown)}")
    return data


def load_settings(flags: Mapping[str, Any], env: Mapping[str, str] | None = None,
                  config_file: str | None = None) -> RouterSettings:
    """Merge flags, environment and config file into frozen settings.

    Args:
        flags: values given on the command line (``None`` means not given).
        env: the environment (``os.environ`` by default); ``KVROUTE_<NAME>`` per setting.
        config_file: a TOML or JSON file of settings (a ``[router]`` table or top level).

    Raises:
        SettingsError: any value is malformed or out of range.
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    sources: list[tuple[str, Mapping[str, Any]]] = []
    if config_file:
        sources.append((f"config file {config_file}", _read_file(config_file)))
    sources.append(("environment", {k[8:].lower(): v for k, v in env.items()
                                    if k.startswith("KVROUTE_") and k[8:].lower() in _TYPES}))
    sources.append(("flag", {k: v for k, v in flags.items() if v is not None and v != ()}))
    for origin, values in sources:
        for name, value in values.items():
            if name in _TYPES:
                merged[name] = _coerce(name, value, origin)
    return RouterSettings(**merged)
