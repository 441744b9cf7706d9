"""Worker settings: read once from flags and environment (``KVROUTE_WORKER_*``), then frozen.

Precedence: flag > environment > default. Every bad value is refused with a message naming the
setting and where it came from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from httpapi.auth import check_bind, check_token, is_loopback, read_secret_file, transfer_secret
from httpapi.logs import LOG_FORMATS
from httpapi.server import DEFAULT_LIMITS, ConnectionLimits
from httpapi.tracing import endpoint_configured, missing_sdk
from openai_request.bodies import MAX_BODY_BYTES
from openai_request.tokenizer_source import resolve_tokenizer
from workers.cache.publisher import CurveServerKeys
from workers.engine.timing import DEFAULT_TIMING, TIMING_MODELS
from workers.http.image_policy import ImageHostPolicy
from workers.http.image_read_ahead import READ_BYTES, least_read_ahead

__all__ = ["WorkerSettings", "WorkerSettingsError", "load_worker_settings"]

ENV_PREFIX = "KVROUTE_WORKER_"
#: The transfer secret's file, named alike for the router and the workers.
SHARED_SECRET_ENV = "KVROUTE_KV_TRANSFER_SECRET_FILE"


class WorkerSettingsError(ValueError):
    """A worker setting is malformed or out of range."""


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """Everything a worker needs at start-up."""

    host: str = "127.0.0.1"
    port: int = 8100
    events_host: str = "127.0.0.1"
    events_port: int | None = 5557
    replay_port: int | None = 5558
    topic: str = ""
    data_parallel_rank: int = 0
    #: Engines in this process, each with a cache of its own, behind the one HTTP port; their
    #: events go out on the one publisher, each batch naming its rank (0..N-1).
    data_parallel_size: int = 1
    #: Disaggregated serving, sim engine: a transfer of KV from a prefill worker takes
    #: tokens * kv_bytes_per_token / kv_transfer_bandwidth seconds (divided by ``speedup``).
    #: The defaults: a Llama-3-8B token in bf16 (128 KiB), over 25 GB/s.
    kv_bytes_per_token: int = 131072
    kv_transfer_bandwidth: float = 25e9
    #: Seconds a prefill worker holds a prefill's blocks for a decode worker that has not
    #: taken them (vLLM's lease; divided by ``speedup``).
    kv_lease_seconds: float = 30.0
    #: Peer KV transfer (docs/kv_transfer.md): the secret shared by the router and every
    #: worker, read from ``kv_transfer_secret_file`` (or ``KVROUTE_KV_TRANSFER_SECRET_FILE``).
    #: Without one, KV is served to and fetch instructions taken from loopback only.
    kv_transfer_secret: str | None = field(default=None, repr=False)
    kv_transfer_secret_file: str | None = None
    #: Seconds one peer fetch may take, waiting for a fetch slot to the last byte.
    kv_fetch_timeout: float = 10.0
    #: Peer fetches this worker runs at once (a request past them waits for a slot).
    kv_fetch_concurrency: int = 4
    #: Block reads this worker serves at once (a read past them is answered 503).
    kv_read_concurrency: int = 2
    #: Peer KV fetch between torch workers on one GPU: copy blocks device to device over
    #: CUDA IPC (docs/kv_transfer.md), with a ``kv_transfer_secret`` only; off, or where it
    #: cannot be used, blocks travel over HTTP.
    kv_fetch_ipc: bool = True
    #: Bytes a second a peer fetch over HTTP moves to or from this worker, as it advertises
    #: it to routers, which price a pair's first fetch by it (0: the engine's own figure,
    #: :func:`workers.http.kv_fetch.http_bandwidth`).
    kv_fetch_bandwidth: float = 0.0
    engine: str = "sim"
    model: str = "kvroute-sim"
    tokenizer: str | None = None
    block_size: int = 32
    num_blocks: int = 4096
    host_blocks: int = 0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    #: Prefills with at most this many tokens left go ahead of longer ones (0: first come,
    #: first served); ``short_pass_tokens`` caps the longer ones in an iteration that ends a
    #: prompt (:class:`workers.engine.batcher.Batcher`).
    short_prefill: int = 0
    short_pass_tokens: int = 0
    max_model_len: int = 65536
    speedup: float = 1.0
    timing: str = DEFAULT_TIMING
    mm_tokens_per_image: int = 16
    images: bool = True
    prefix_caching: bool = True
    image_hints: bool = True
    image_hint_capacity: int = 4096
    max_image_bytes: int = 20 * 1024 * 1024
    max_images_per_request: int = 16
    max_image_request_bytes: int = 64 * 1024 * 1024
    max_image_fetch_bytes: int = 256 * 1024 * 1024
    #: A request's image bytes fetched and not yet used, at most
    #: (:mod:`workers.http.image_read_ahead`).
    max_image_read_ahead_bytes: int = 64 * 1024 * 1024
    image_fetch_timeout: float = 5.0
    allow_image_hosts: tuple[str, ...] = ()
    # event-plane security: CURVE on the event sockets, a keyed salt tag
    curve_secret_key: str | None = None
    curve_authorized_clients: str | None = None
    salt_secret: str | None = field(default=None, repr=False)
    salt_secret_file: str | None = None
    replay_buffer: int = 10_000
    max_pending_stored: int = 4096
    loras: tuple[str, ...] = ()
    admin_token: str | None = None
    seed: int = 0
    log_level: str = "info"
    #: ``text`` or ``json`` (httpapi.logs).
    log_format: str = "text"
    # torch engine only
    torch_model: str = "tiny"
    device: str = "auto"
    kv_memory_gb: float | None = None
    cuda_graphs: bool = True
    # The HTTP boundary: admin token source, open-bind consent, connection limits.
    admin_token_file: str | None = None
    insecure_no_auth: bool = False
    #: Publish KV events off loopback without CURVE (``insecure_no_auth`` consents too).
    insecure_events: bool = False
    max_connections: int = DEFAULT_LIMITS.max_connections
    header_timeout: float = DEFAULT_LIMITS.header_timeout
    keep_alive_timeout: float = DEFAULT_LIMITS.keep_alive_timeout
    max_header_bytes: int = DEFAULT_LIMITS.max_header_bytes
    body_timeout: float = DEFAULT_LIMITS.body_timeout
    body_idle_timeout: float = DEFAULT_LIMITS.body_idle_timeout
    max_body_bytes: int = MAX_BODY_BYTES
    gpu_memory_utilization: float = 0.9
    #: A span per generation request over OTLP, a child of the router's (also on when the
    #: environment names an OTLP endpoint: httpapi.tracing); needs the ``otel`` extra.
    tracing: bool = False

    def __post_init__(self) -> None:
        positive = ("port", "block_size", "num_blocks", "max_num_batched_tokens",
                    "max_num_seqs", "max_model_len", "mm_tokens_per_image",
                    "image_hint_capacity", "max_image_bytes", "max_images_per_request",
                    "max_image_request_bytes", "max_image_fetch_bytes",
                    "max_image_read_ahead_bytes", "replay_buffer",
                    "max_pending_stored", "max_body_bytes", "kv_fetch_concurrency",
                    "kv_read_concurrency")
        for name in positive:
            if getattr(self, name) <= 0:
                raise WorkerSettingsError(f"{name} must be positive, got {getattr(self, name)}")
        if self.data_parallel_size < 1:
            raise WorkerSettingsError(
                f"data_parallel_size must be positive, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and self.data_parallel_rank:
            raise WorkerSettingsError(
                "data_parallel_size > 1 serves ranks 0..N-1 itself; give no data_parallel_rank")
        if self.data_parallel_size > 1 and self.engine == "torch":
            raise WorkerSettingsError(
                "data_parallel_size > 1 runs sim engines only; run one torch worker per rank")
        for name in ("host_blocks", "data_parallel_rank", "short_prefill", "short_pass_tokens",
                     "kv_fetch_bandwidth"):
            if getattr(self, name) < 0:
                raise WorkerSettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        self._check_ports()
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise WorkerSettingsError(f"{f.name} must be a finite number, got {value}")
        try:
            check_token(self.admin_token, "admin_token")
        except ValueError as exc:
            raise WorkerSettingsError(str(exc)) from None
        if not 0 < self.gpu_memory_utilization <= 1:
            raise WorkerSettingsError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_bytes_per_token <= 0 or self.kv_transfer_bandwidth <= 0 \
                or self.kv_lease_seconds <= 0 or self.kv_fetch_timeout <= 0:
            raise WorkerSettingsError("kv_bytes_per_token, kv_transfer_bandwidth, "
                                      "kv_lease_seconds and kv_fetch_timeout must be positive")
        self._read_transfer_secret()
        if self.speedup <= 0:
            raise WorkerSettingsError(f"speedup must be positive, got {self.speedup}")
        if self.timing not in TIMING_MODELS:
            raise WorkerSettingsError(
                f"timing must be {' or '.join(map(repr, TIMING_MODELS))}, got {self.timing!r}")
        if self.tokenizer is not None:  # at start, as one line, not in the app's lifespan
            try:
                resolve_tokenizer(self.tokenizer)
            except ValueError as exc:
                raise WorkerSettingsError(str(exc)) from None
        if self.log_format not in LOG_FORMATS:
            raise WorkerSettingsError(f"log_format must be {' or '.join(map(repr, LOG_FORMATS))}, "
                                      f"got {self.log_format!r}")
        if self.engine not in ("sim", "torch"):
            raise WorkerSettingsError(f"engine must be 'sim' or 'torch', got {self.engine!r}")
        if self.max_num_batched_tokens < self.block_size:
            raise WorkerSettingsError("max_num_batched_tokens must be at least block_size")
        least = least_read_ahead(self.max_image_bytes)
        if self.max_image_read_ahead_bytes < least:
            raise WorkerSettingsError(
                f"max_image_read_ahead_bytes must hold one whole image (max_image_bytes "
                f"{self.max_image_bytes}) and two reads of {READ_BYTES}: at least {least}, "
                f"got {self.max_image_read_ahead_bytes}")
        try:
            ImageHostPolicy.parse(self.allow_image_hosts)
        except ValueError as exc:
            raise WorkerSettingsError(f"allow_image_hosts: {exc}") from None
        if (self.curve_secret_key is None) != (self.curve_authorized_clients is None):
            raise WorkerSettingsError("curve_secret_key and curve_authorized_clients go "
                                      "together: CURVE without authorized clients admits anyone")
        if self.curve_secret_key is not None:
            try:
                CurveServerKeys.load(self.curve_secret_key, self.curve_authorized_clients or "")
            except ValueError as exc:
                raise WorkerSettingsError(str(exc)) from None
        if self.salt_secret_file is not None:  # read once; the file wins over salt_secret
            object.__setattr__(self, "salt_secret", _read_secret(self.salt_secret_file))
        if self.salt_secret is not None and not self.salt_secret:
            raise WorkerSettingsError("salt_secret is empty")
        if (self.events_port is not None and not is_loopback(self.events_host)
                and self.curve_secret_key is None
                and not (self.insecure_events or self.insecure_no_auth)):
            raise WorkerSettingsError(
                f"the worker would publish KV events on {self.events_host} without CURVE: "
                "anyone who reaches the event ports reads the token ids of every cached "
                "prompt. Give CURVE keys (--curve-secret-key, --curve-authorized-clients), "
                "bind --events-host 127.0.0.1, or pass --insecure-events to accept the risk")
        if self.tracing and (missing := missing_sdk("--tracing")) is not None:
            raise WorkerSettingsError(missing)
        try:
            self.connection_limits()
            check_bind(self.host, self.admin_token, self.insecure_no_auth, "worker")
        except ValueError as exc:
            raise WorkerSettingsError(str(exc)) from None

    def _read_transfer_secret(self) -> None:
        try:  # read once; the file wins
            object.__setattr__(self, "kv_transfer_secret", transfer_secret(
                self.kv_transfer_secret, self.kv_transfer_secret_file))
        except ValueError as exc:
            raise WorkerSettingsError(str(exc)) from None

    @property
    def kv_transfer_open(self) -> bool:
        """Whether this worker serves KV and takes fetch instructions at all: with a secret,
        or bound to loopback (then from loopback peers only)."""
        return self.kv_transfer_secret is not None or is_loopback(self.host)

    def _check_ports(self) -> None:
        if not 0 < self.port < 65536:
            raise WorkerSettingsError(f"port must be in 1..65535, got {self.port}")
        for name in ("events_port", "replay_port"):
            port = getattr(self, name)
            if port is None:
                continue
            if not 0 <= port < 65536:  # 0: any free port
                raise WorkerSettingsError(f"{name} must be in 0..65535, got {port}")
            if port and port + self.data_parallel_rank >= 65536:
                raise WorkerSettingsError(
                    f"{name} {port} + data_parallel_rank {self.data_parallel_rank} must be in "
                    "0..65535 (each rank publishes on its own port)")

    def connection_limits(self) -> ConnectionLimits:
        """The HTTP server's connection limits and timeouts."""
        return ConnectionLimits(self.max_connections, self.header_timeout,
                                self.keep_alive_timeout, self.max_header_bytes,
                                self.body_timeout, self.body_idle_timeout)

    @property
    def events_enabled(self) -> bool:
        """Whether KV events are published (a port is set and prefix caching is on)."""
        return self.events_port is not None and self.prefix_caching

    @property
    def curve_keys(self) -> CurveServerKeys | None:
        """The event sockets' CURVE keys, read from their files; None without CURVE."""
        if self.curve_secret_key is None or self.curve_authorized_clients is None:
            return None
        return CurveServerKeys.load(self.curve_secret_key, self.curve_authorized_clients)

    @property
    def salt_key(self) -> bytes | None:
        """The cluster secret that keys published salt tags, or None (unkeyed tags)."""
        return None if self.salt_secret is None else self.salt_secret.encode()

    @property
    def image_routing_version(self) -> int | None:
        """1 when events, block reuse, images and hints are all on; else None."""
        on = self.events_enabled and self.images and self.image_hints
        return 1 if on else None


def _read_secret(path: str) -> str:
    try:
        return read_secret_file(path, "salt_secret_file")
    except ValueError as exc:
        raise WorkerSettingsError(str(exc)) from None


_FIELDS = {f.name: f.type for f in fields(WorkerSettings)}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _coerce(name: str, value: Any, origin: str) -> Any:
    kind = str(_FIELDS[name])
    try:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "")
                             and "None" in kind):
            return None
        if name in ("loras", "allow_image_hosts"):
            items = value.split(",") if isinstance(value, str) else value
            return tuple(s.strip() for s in items if s.strip())
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text not in _TRUE | _FALSE:
                raise ValueError
            return text in _TRUE
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise WorkerSettingsError(f"{name} from {origin}: {value!r} is not a valid {kind}"
                                  ) from None


def load_worker_settings(flags: Mapping[str, Any], env: Mapping[str, str] | None = None
                         ) -> WorkerSettings:
    """Merge flags over ``KVROUTE_WORKER_*`` environment variables over defaults.

    Raises:
        WorkerSettingsError: a value is malformed or out of range.
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    if env.get(SHARED_SECRET_ENV):  # below KVROUTE_WORKER_* and flags
        merged["kv_transfer_secret_file"] = env[SHARED_SECRET_ENV]
    for key, value in env.items():
        name = key[len(ENV_PREFIX):].lower() if key.startswith(ENV_PREFIX) else None
        if name in _FIELDS:
            merged[name] = _coerce(name, value, f"environment {key}")
    for name, value in flags.items():
        if name in _FIELDS and value is not None:
            merged[name] = _coerce(name, value, f"flag --{name.replace('_', '-')}")
    if merged.get("engine") == "torch" and "model" in merged and "torch_model" not in merged:
        # ``--engine torch --model llama-1b|PATH`` names the weights, as vLLM's --model does;
        # the served name is the same string.
        merged["torch_model"] = merged["model"]
    if "tracing" not in merged and endpoint_configured(env):
        merged["tracing"] = True  # the OpenTelemetry convention: an endpoint turns it on
    if merged.get("admin_token_file"):
        if merged.get("admin_token"):
            raise WorkerSettingsError("give admin_token or admin_token_file, not both")
        try:
            merged["admin_token"] = read_secret_file(merged["admin_token_file"], "admin_token_file")
        except ValueError as exc:
            raise WorkerSettingsError(str(exc)) from None
    return WorkerSettings(**merged)
