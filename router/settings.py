"""Router settings: read once at start-up from flags, environment and a config file, then
frozen and passed down (starlette's ``config.py`` is the model).

Precedence: command-line flag > environment (``KVROUTE_*``) > config file (TOML or JSON,
``--config``) > default. Every bad value is refused with a message naming where it came from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from router.core import CoreSettings
from router.scheduler import SchedulerConfig

__all__ = ["POLICIES", "RouterSettings", "SettingsError", "load_settings"]

#: ``kv``: prefix hits weighed against load (the point of kvroute). ``dynamo``: NVIDIA Dynamo's
#: cost rule (:meth:`router.scheduler.SchedulerConfig.dynamo`; ``--overlap-weight`` still
#: applies). ``round_robin`` and ``random`` ignore the cache: baselines to measure against.
POLICIES = ("kv", "dynamo", "round_robin", "random")

#: The cost rule's defaults, defined once (:class:`router.scheduler.SchedulerConfig`).
_RULE = SchedulerConfig()
_CORE = CoreSettings()


class SettingsError(ValueError):
    """A setting is missing, malformed or out of range; the message says which and where."""


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything the router needs to know at start-up."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: tuple[str, ...] = ()
    block_size: int = 32
    tokenizer: str | None = None
    policy: str = "kv"
    overlap_weight: float = _RULE.overlap_weight
    #: None: ``auto`` (by eviction pressure, :mod:`router.pressure`).
    queue_weight: float | None = None
    session_weight: float = _RULE.session_weight
    sessions: bool = _CORE.sessions
    predict_ttl: float = _CORE.predict_ttl
    approximate_ttl: float = _CORE.approximate_ttl
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
            (self.session_weight >= 0, "session_weight must be >= 0 (0 = no session term)"),
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
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise SettingsError(f"worker {url!r} is not an http(s) URL")

    def core_settings(self) -> CoreSettings:
        """The routing core's settings these give (``policy`` ``dynamo``: Dynamo's rule at
        this overlap weight, the queue weight fixed at 1 unless set, no sessions)."""
        if self.policy == "dynamo":
            rule = dataclasses.replace(SchedulerConfig.dynamo(),
                                       overlap_weight=self.overlap_weight,
                                       queue_weight=1.0 if self.queue_weight is None
                                       else self.queue_weight)
            return CoreSettings(rule, auto_queue=False, predict_ttl=self.predict_ttl,
                                approximate_ttl=self.approximate_ttl, sessions=False)
        rule = dataclasses.replace(
            _RULE, overlap_weight=self.overlap_weight,
            queue_weight=_RULE.queue_weight if self.queue_weight is None else self.queue_weight,
            session_weight=self.session_weight if self.sessions else 0.0)
        return CoreSettings(rule, auto_queue=self.queue_weight is None,
                            predict_ttl=self.predict_ttl, approximate_ttl=self.approximate_ttl,
                            sessions=self.sessions)


_TYPES = {f.name: f.type for f in fields(RouterSettings)}
_TRUE, _FALSE = ("on", "true", "yes", "1"), ("off", "false", "no", "0")


def _coerce(name: str, value: Any, origin: str) -> Any:
    kind = _TYPES[name]
    try:
        if name == "workers":
            if isinstance(value, str):
                value = [v for v in (p.strip() for p in value.split(",")) if v]
            return tuple(str(v).rstrip("/") for v in value)
        if value is None:
            return None
        if kind in ("int", "int | None"):
            return int(value)
        if kind == "bool":
            word = str(value).strip().lower()
            if word not in _TRUE + _FALSE:
                raise ValueError(word)
            return word in _TRUE
        if kind == "float | None" and str(value).strip().lower() in ("auto", "none", ""):
            return None
        if kind in ("float", "float | None"):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
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
