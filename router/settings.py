"""Router settings: read once at start-up from flags, environment and a config file, then
frozen and passed down (starlette's ``config.py`` is the model).

Precedence: command-line flag > environment (``KVROUTE_*``) > config file (TOML or JSON,
``--config``) > default. Every bad value is refused with a message naming where it came from.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from httpapi.api_keys import KeyRing, parse_keys
from httpapi.auth import check_bind, check_token, is_loopback, read_secret_file, transfer_secret
from httpapi.logs import LOG_FORMATS
from httpapi.server import DEFAULT_LIMITS, ConnectionLimits
from httpapi.tracing import endpoint_configured, missing_sdk
from httpapi.trusted_peers import LOOPBACK, TrustedPeers
from openai_request.bodies import MAX_BODY_BYTES
from openai_request.tokenizer_source import resolve_tokenizer
from router.events.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_RECEIVE_HWM,
    CurveClientKeys,
    EventTransport,
)
from router.fleet.discovery import parse_target
from router.fleet.entry import FleetSettings
from router.fleet.worker_config import format_worker, parse_workers
from router.routing.admission import FlowSettings
from router.routing.core import CoreSettings
from router.routing.disaggregation import PrefillLink
from router.routing.policy import POLICIES, Policy, policy_named
from router.routing.rates import parse_rates

__all__ = ["POLICIES", "RouterSettings", "SettingsError", "load_settings"]

#: The routing core's defaults, defined once (:class:`router.routing.core.CoreSettings`):
#: ``kv``, each worker priced by its predicted time to first token; ``dynamo``, NVIDIA
#: Dynamo's cost rule in blocks; ``round_robin`` and ``random`` ignore the cache (baselines).
TOKENIZE_MODES = ("match", "full")
#: ``auto``: price peer fetches between the workers that advertise them; ``off``: never.
KV_FETCH_MODES = ("auto", "off")
#: The shortest KV transfer secret accepted (the workers' rule too).
_CORE = CoreSettings()
_FLOW = FlowSettings()


class SettingsError(ValueError):
    """A setting is missing, malformed or out of range; the message says which and where."""


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything the router needs to know at start-up."""

    host: str = "127.0.0.1"
    port: int = 8000
    #: Each worker in its flat text form: ``URL[,engine=...,events=...]``
    #: (router.fleet.worker_config).
    workers: tuple[str, ...] = ()
    block_size: int = 32
    tokenizer: str | None = None
    #: ``match``: cached segments, only as far as some worker holds the prompt's blocks (the
    #: rest estimated); ``full``: every token, the whole prompt at once, as the workers do.
    tokenize: str = "match"
    policy: str = "kv"
    #: Rates per token set by hand (``prefill=S,context=S,decode=S,onboard=S,first=S``,
    #: :func:`router.routing.rates.parse_rates`); None: each engine kind's, learned.
    rates: str | None = None
    #: Learn each worker's rate factor from its first tokens.
    learn_rates: bool = _CORE.learn
    sessions: bool = _CORE.sessions
    predict_ttl: float = _CORE.predict_ttl
    #: The time to first token clients accept, in seconds (None: none stated): in a busy
    #: fleet the ``kv`` rule takes, of the workers predicted within it, the one with the
    #: least prefill to do (docs/routing.md, "A TTFT objective").
    ttft_slo: float | None = _CORE.ttft_slo
    approximate_ttl: float = _CORE.approximate_ttl
    health_interval: float = 1.0
    unhealthy_grace: float = 5.0
    health_timeout: float = 1.0
    health_misses: int = 2
    connect_timeout: float = 2.0
    first_byte_timeout: float = 300.0
    first_byte_floor: float = 2.0
    first_byte_factor: float = 4.0
    max_image_bytes: int = 20 * 1024 * 1024
    admin_token: str | None = None
    worker_admin_token: str | None = None
    seed: int | None = None
    log_level: str = "info"
    #: ``text`` or ``json`` (httpapi.logs).
    log_format: str = "text"
    # event plane: message limits, CURVE keys, the salt-tag secret
    event_max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    event_receive_hwm: int = DEFAULT_RECEIVE_HWM
    curve_secret_key: str | None = None
    curve_server_key: str | None = None
    salt_secret: str | None = field(default=None, repr=False)
    salt_secret_file: str | None = None
    # The HTTP boundary: admin token sources, open-bind consent, connection limits.
    admin_token_file: str | None = None
    worker_admin_token_file: str | None = None
    insecure_no_auth: bool = False
    max_connections: int = DEFAULT_LIMITS.max_connections
    header_timeout: float = DEFAULT_LIMITS.header_timeout
    keep_alive_timeout: float = DEFAULT_LIMITS.keep_alive_timeout
    max_header_bytes: int = DEFAULT_LIMITS.max_header_bytes
    body_timeout: float = DEFAULT_LIMITS.body_timeout
    body_idle_timeout: float = DEFAULT_LIMITS.body_idle_timeout
    max_body_bytes: int = MAX_BODY_BYTES
    #: DNS names whose addresses are workers (``dns:///NAME:PORT``; router.fleet.discovery)
    #: and EndpointSlices whose ready endpoints are (``k8s://NAMESPACE/LABEL-SELECTOR``).
    discover: tuple[str, ...] = ()
    discover_interval: float = 5.0
    #: Disaggregated serving: a decode worker that would have at most this many prompt tokens
    #: left to compute prefills them itself, no remote prefill (docs/routing.md; the
    #: benchmark that chose 256 is in docs/benchmarks.md).
    pd_local_prefill_tokens: int = 256
    #: Seconds a remote prefill may take before the request is served whole on its decode
    #: worker instead.
    pd_prefill_timeout: float = 60.0
    #: Disaggregated serving: the KV bytes of one token and the prefill-to-decode link's bytes
    #: a second, which price a remote prefill's transfer in its predicted time to first token
    #: (the defaults: the default rates' model, 32 KiB a token, over 25 GB/s).
    pd_kv_bytes_per_token: int = 32768
    pd_transfer_bandwidth: float = 25e9
    #: Take ``kv_transfer_params``, SGLang's ``bootstrap_*`` fields and the
    #: ``X-data-parallel-rank`` header from clients (router.http.client_fields): off, a body
    #: setting one is refused (400) and the header dropped.
    allow_client_transfer_fields: bool = False
    # Flow control (router.routing.admission): saturation bounds, the queue, deadlines, weights.
    flow_control: bool = _FLOW.enabled
    flow_ttft_bound: float = _FLOW.ttft_bound_s
    flow_kv_threshold: float = _FLOW.kv_threshold
    flow_max_queue: int = _FLOW.max_queue
    flow_max_wait: float = _FLOW.max_wait_s
    flow_seq_gate: bool = _FLOW.seq_gate
    flow_urgent_share: float = _FLOW.urgent_share
    flow_ttft_budget: float = _FLOW.ttft_budget_s
    #: ``PRIORITY=SECONDS,...``: a TTFT deadline per priority.
    flow_deadlines: str = ""
    #: ``TENANT=WEIGHT,...``: each tenant's share inside its priority (1 when not named).
    tenant_weights: str = ""
    #: ``NAME=PRIORITY,...``: the priority of each Gateway API Inference Extension
    #: ``InferenceObjective`` a request names in ``x-gateway-inference-objective``, as the
    #: objective's ``spec.priority`` reads (higher is more urgent).
    objective_priorities: str = ""
    #: The peers (addresses, CIDR blocks, ``any`` or ``none``) whose flow-control headers
    #: and body ``priority`` are believed (router.http.client_trust); loopback by default.
    trusted_clients: str = LOOPBACK
    # -- Client API keys, the autoscaling signal, tracing (router.http.client_quotas,
    # router.http.demand_metrics, router.http.tracing); each off unless configured. --
    #: The keys file's lines (``;`` between them; httpapi.api_keys): salted hashes, never keys.
    api_keys: str | None = field(default=None, repr=False)
    #: A keys file, read once at start-up into ``api_keys``.
    api_keys_file: str | None = None
    #: Prompt tokens per minute of a key whose line sets none; 0: no limit.
    api_key_tokens_per_minute: int = 0
    #: Seconds over which the uncached prompt tokens routed are averaged for
    #: ``kvroute_prefill_demand_ratio`` (an exponentially decaying rate).
    demand_window: float = 60.0
    #: Export a span per request over OTLP (also on when the environment names an OTLP
    #: endpoint: httpapi.tracing); needs the ``otel`` extra.
    tracing: bool = False
    #: Peer KV fetch (docs/peer_fetch.md): ``auto`` prices a fetch between workers that
    #: advertise it, ``off`` never; the secret shared with every worker, read from its file.
    kv_fetch: str = "auto"
    kv_transfer_secret_file: str | None = None
    kv_transfer_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):  # inf or nan: a weight that swamps every other, a wait forever
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingsError(f"{f.name} must be a finite number, got {value}")
        for name in ("admin_token", "worker_admin_token"):
            try:
                check_token(getattr(self, name), name)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        checks = [
            (0 < self.port < 65536, f"port {self.port} is not in 1..65535"),
            (self.block_size > 0, f"block_size {self.block_size} must be positive"),
            (self.tokenize in TOKENIZE_MODES,
             f"tokenize {self.tokenize!r} is not one of {', '.join(TOKENIZE_MODES)}"),
            (self.policy in POLICIES,
             f"policy {self.policy!r} is not one of {', '.join(POLICIES)}"),
            (self.predict_ttl > 0 and self.approximate_ttl > 0, "ttls must be positive"),
            (self.ttft_slo is None or self.ttft_slo > 0, "ttft_slo must be positive"),
            (self.ttft_slo is None or self.policy not in POLICIES
             or policy_named(self.policy).takes_slo,
             f"ttft_slo applies to the kv policy, not {self.policy!r}"),
            (self.health_interval > 0, "health_interval must be positive"),
            (self.health_misses >= 1, "health_misses must be at least 1"),
            (self.unhealthy_grace >= 0, "unhealthy_grace must be >= 0"),
            (self.connect_timeout > 0 and self.first_byte_timeout > 0
             and self.health_timeout > 0, "timeouts must be positive"),
            (0 < self.first_byte_floor <= self.first_byte_timeout,
             "first_byte_floor must be positive and at most first_byte_timeout"),
            (self.first_byte_factor >= 1, "first_byte_factor must be >= 1"),
            (self.pd_local_prefill_tokens >= 0, "pd_local_prefill_tokens must be >= 0"),
            (self.pd_prefill_timeout > 0, "pd_prefill_timeout must be positive"),
            (self.pd_kv_bytes_per_token > 0 and self.pd_transfer_bandwidth > 0,
             "pd_kv_bytes_per_token and pd_transfer_bandwidth must be positive"),
            (self.max_image_bytes > 0, "max_image_bytes must be positive"),
            (self.event_max_message_bytes > 0, "event_max_message_bytes must be positive"),
            (self.event_receive_hwm > 0, "event_receive_hwm must be positive"),
            ((self.curve_secret_key is None) == (self.curve_server_key is None),
             "curve_secret_key and curve_server_key go together"),
            (self.max_body_bytes > 0, "max_body_bytes must be positive"),
            (self.discover_interval > 0, "discover_interval must be positive"),
            (self.log_format in LOG_FORMATS,
             f"log_format {self.log_format!r} is not one of {', '.join(LOG_FORMATS)}"),
            (self.kv_fetch in KV_FETCH_MODES,
             f"kv_fetch {self.kv_fetch!r} is not one of {', '.join(KV_FETCH_MODES)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)
        if self.tokenizer is not None:  # at start, as one line, not in the app's lifespan
            try:
                resolve_tokenizer(self.tokenizer)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        if self.rates is not None:
            try:
                parse_rates(self.rates)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        if self.salt_secret_file is not None:  # read once; the file wins over salt_secret
            try:
                secret = read_secret_file(self.salt_secret_file, "salt_secret_file")
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
            object.__setattr__(self, "salt_secret", secret)
        if self.salt_secret is not None and not self.salt_secret:
            raise SettingsError("salt_secret is empty")
        try:  # read once; the file wins
            object.__setattr__(self, "kv_transfer_secret", transfer_secret(
                self.kv_transfer_secret, self.kv_transfer_secret_file))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if self.curve_secret_key is not None:
            self.event_transport()  # unreadable keys fail at start-up, not at first connect
        try:
            self.connection_limits()
            check_bind(self.host, self.admin_token, self.insecure_no_auth, "router")
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        try:  # each entry is a worker's flat text form (router.fleet.worker_config)
            parse_workers(list(self.workers))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        for target in self.discover:
            try:
                parse_target(target)
            except ValueError as exc:
                raise SettingsError(f"discover: {exc}") from None
        self.flow_settings()
        self.objectives()
        try:
            TrustedPeers.parse(self.trusted_clients)
        except ValueError as exc:
            raise SettingsError(f"trusted_clients: {exc}") from None
        self._check_extensions()

    def flow_settings(self) -> FlowSettings:
        """Flow control's bounds, deadlines per priority and tenant weights.

        Raises:
            SettingsError: a bound is out of range, or a pair is not ``KEY=NUMBER``.
        """
        try:
            deadlines = {}
            for key, seconds in _pairs(self.flow_deadlines, "flow_deadlines"):
                try:
                    deadlines[int(key)] = seconds
                except ValueError:
                    raise ValueError(f"flow_deadlines: priority {key!r} is not an integer"
                                     ) from None
            return FlowSettings(enabled=self.flow_control, ttft_bound_s=self.flow_ttft_bound,
                                kv_threshold=self.flow_kv_threshold,
                                max_queue=self.flow_max_queue, max_wait_s=self.flow_max_wait,
                                seq_gate=self.flow_seq_gate,
                                urgent_share=self.flow_urgent_share,
                                ttft_budget_s=self.flow_ttft_budget,
                                deadlines=deadlines,
                                weights=dict(_pairs(self.tenant_weights, "tenant_weights")))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None

    def objectives(self) -> dict[str, int]:
        """Each named ``InferenceObjective``'s priority in flow control's order (lower is more
        urgent): its ``spec.priority`` (higher is more urgent) negated.

        Raises:
            SettingsError: an entry is not ``NAME=INTEGER``.
        """
        out = {}
        try:
            for name, value in _pairs(self.objective_priorities, "objective_priorities"):
                if value != int(value):
                    raise ValueError(f"objective_priorities: the priority of {name!r} must be "
                                     f"an integer, got {value}")
                out[name] = -int(value)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        return out

    def connection_limits(self) -> ConnectionLimits:
        """The HTTP server's connection limits and timeouts."""
        return ConnectionLimits(self.max_connections, self.header_timeout,
                                self.keep_alive_timeout, self.max_header_bytes,
                                self.body_timeout, self.body_idle_timeout)

    @property
    def salt_key(self) -> bytes | None:
        """The cluster secret that keys salt tags, or None (unkeyed tags)."""
        return None if self.salt_secret is None else self.salt_secret.encode()

    def event_transport(self) -> EventTransport:
        """The event sockets' limits and CURVE keys (read from their files).

        Raises:
            SettingsError: a CURVE key file is missing or unusable.
        """
        curve = None
        if self.curve_secret_key is not None and self.curve_server_key is not None:
            try:
                curve = CurveClientKeys.load(self.curve_secret_key, self.curve_server_key)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        return EventTransport(self.event_max_message_bytes, self.event_receive_hwm, curve)

    def fleet_settings(self) -> FleetSettings:
        """What the registry reads: workers, discovery, health polling and the event plane.

        Raises:
            SettingsError: a CURVE key file is missing or unusable.
        """
        return FleetSettings(
            workers=self.workers, discover=self.discover,
            discover_interval=self.discover_interval, block_size=self.block_size,
            health_interval=self.health_interval, health_timeout=self.health_timeout,
            health_misses=self.health_misses,
            unhealthy_grace=self.unhealthy_grace, worker_admin_token=self.worker_admin_token,
            event_transport=self.event_transport())

    def fetch_reachable(self, worker_url: str) -> bool:
        """Whether a peer fetch may be priced to or from the worker at ``worker_url``: with
        the shared secret, any; without, only one on loopback (the workers honour
        unauthenticated instructions from loopback peers of a loopback bind alone)."""
        if self.kv_transfer_secret is not None:
            return True
        return is_loopback(urlsplit(worker_url).hostname or "")

    def prefill_link(self) -> PrefillLink:
        """A remote prefill's settings (``--pd-*``)."""
        return PrefillLink(self.pd_local_prefill_tokens, self.pd_kv_bytes_per_token,
                           self.pd_transfer_bandwidth)

    @property
    def rule(self) -> Policy:
        """The routing policy ``policy`` names."""
        return policy_named(self.policy)

    def core_settings(self) -> CoreSettings:
        """The routing core's settings these give (sessions are followed only by a policy
        that follows them, ``kv``)."""
        return CoreSettings(policy=self.policy, block_size=self.block_size,
                            rates=parse_rates(self.rates) if self.rates else None,
                            learn=self.learn_rates, predict_ttl=self.predict_ttl,
                            approximate_ttl=self.approximate_ttl,
                            sessions=self.sessions and self.rule.follows_sessions,
                            ttft_slo=self.ttft_slo, kv_fetch=self.kv_fetch == "auto",
                            fetch_bandwidth=self.pd_transfer_bandwidth)


    def _check_extensions(self) -> None:
        """Read the keys file into ``api_keys`` and check the block's values.

        Raises:
            SettingsError: both or an unreadable keys file, a malformed key line, a negative
                quota, a window that is not positive.
        """
        if self.api_keys_file is not None:
            if self.api_keys is not None:
                raise SettingsError("give api_keys or api_keys_file, not both")
            try:
                text = Path(self.api_keys_file).read_text()
            except OSError as exc:
                raise SettingsError(f"api_keys_file {self.api_keys_file}: {exc.strerror}"
                                    ) from None
            object.__setattr__(self, "api_keys", text)
        self.client_key_ring()
        if self.api_key_tokens_per_minute < 0:
            raise SettingsError("api_key_tokens_per_minute must be >= 0")
        if not self.demand_window > 0:
            raise SettingsError("demand_window must be positive")
        if self.tracing and (missing := missing_sdk("--tracing")) is not None:
            raise SettingsError(missing)

    def client_key_ring(self) -> KeyRing | None:
        """The client API keys (None: ``/v1/*`` is open).

        Raises:
            SettingsError: a malformed key line.
        """
        if self.api_keys is None:
            return None
        origin = self.api_keys_file or "api_keys"
        try:
            return KeyRing(parse_keys(self.api_keys, origin))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None


def _pairs(text: str, name: str) -> list[tuple[str, float]]:
    """``KEY=NUMBER,...`` as pairs.

    Raises:
        ValueError: an entry is not ``KEY=NUMBER``.
    """
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.rpartition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            out.append((key.strip(), float(value)))
        except ValueError:
            raise ValueError(f"{name}: {part!r} is not KEY=NUMBER") from None
    return out


_TYPES = {f.name: f.type for f in fields(RouterSettings)}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
#: Settings read from a file named by another setting (a token kept out of ``ps``).
_TOKEN_FILES = {"admin_token_file": "admin_token",
                "worker_admin_token_file": "worker_admin_token"}


def _coerce(name: str, value: Any, origin: str) -> Any:
    kind = _TYPES[name]
    try:
        if name == "workers":
            return tuple(format_worker(w) for w in parse_workers(value))
        if name == "discover":
            if isinstance(value, str):  # a comma starts a new target only before a scheme:
                # a label selector holds commas of its own (k8s://ns/app=a,tier in (x,y))
                value = [v for v in (p.strip() for p in re.split(r",(?=\s*[a-z0-9]+://)",
                                                                 value)) if v]
            return tuple(str(v).rstrip("/") for v in value)
        if value is None:
            return None
        if kind == "bool":
            text = str(value).strip().lower()
            if isinstance(value, bool) or text in _TRUE | _FALSE:
                return value if isinstance(value, bool) else text in _TRUE
            raise ValueError
        if isinstance(value, (bool, list, dict)):
            raise ValueError  # a file's true is no number, a list or table no text
        if kind in ("int", "int | None"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError  # 1.9 is not taken as 1
            return int(value)
        if kind == "float | None" and str(value).strip().lower() in ("auto", "none", ""):
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
    for file_setting, setting in _TOKEN_FILES.items():
        if merged.get(file_setting):
            if merged.get(setting):
                raise SettingsError(f"give {setting} or {file_setting}, not both")
            try:
                merged[setting] = read_secret_file(merged[file_setting], file_setting)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
    if "tracing" not in merged and endpoint_configured(env):
        merged["tracing"] = True  # the OpenTelemetry convention: an endpoint turns it on
    return RouterSettings(**merged)
