"""How one worker is configured: its URL, the engine behind it, and where its events are.

The same keys are read from four places, so a deployment can use whichever it has:

- a config file's ``[[workers]]`` tables (TOML) or ``"workers": [{...}]`` list (JSON);
- ``POST /workers`` with a JSON object;
- the command line: ``--worker URL,engine=vllm,events=tcp://host:5557``;
- the environment: ``KVROUTE_WORKERS="URL,engine=vllm,events=tcp://...;URL2"``.

In the flat text form a worker starts at each ``http(s)://`` item and every ``key=value`` item
after it belongs to that worker; items are separated by commas, semicolons or white space, so
the older ``url,url`` list still reads as two kvroute workers.

Keys:

``url``
    The worker's HTTP base URL (required).
``engine``
    ``kvroute`` (default: the worker describes itself at ``GET /model_info``), ``vllm``,
    ``sglang`` or ``trtllm`` (a stock engine server; see :mod:`router.fleet.engines`).
``events``
    The engine's KV event PUB endpoint (``tcp://host:port``). Without it a stock worker is
    routed to approximately, from routing history alone. kvroute workers advertise theirs.
``replay``
    The engine's replay ROUTER endpoint (optional).
``block_size``
    Tokens per KV block, for an engine that does not report it (older SGLang); where the
    engine reports it, a different value here is refused.
``dp_size``
    Data-parallel ranks behind the URL (``vllm serve --data-parallel-size N``, SGLang's DP
    attention, ``kvroute worker --data-parallel-size N``): each rank is a cache and a load of
    its own, and a request is pinned to the chosen one with ``X-data-parallel-rank``. Left
    out: the number the engine reports (kvroute's worker at ``/model_info``), else 1.
``role``
    ``both`` (default: serves whole requests), ``prefill`` (prefills for decode workers and
    hands its KV over) or ``decode`` (decodes requests prefilled elsewhere, and prefills
    locally when it already holds most of the prompt). See ``docs/routing.md``.
``bootstrap_port``
    An SGLang prefill server's ``--disaggregation-bootstrap-port`` (8998 when left out): the
    port its decode servers fetch the KV through (:mod:`router.http.bootstrap`).
``max_num_seqs``
    The requests a stock engine runs at once (``vllm serve --max-num-seqs``), which its
    metrics do not say: flow control sends it no more (``docs/flow_control.md``). Left out:
    learned from its running and waiting counts. A kvroute worker says its own.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ENGINES", "MAX_DP_SIZE", "ROLES", "WorkerConfig", "format_worker", "parse_worker",
           "parse_workers"]

#: Engines a worker may name; ``kvroute`` is the bundled worker.
ENGINES = ("kvroute", "vllm", "sglang", "trtllm")

_KEYS = ("url", "engine", "events", "replay", "block_size", "dp_size", "role", "bootstrap_port",
         "max_num_seqs")
#: What a worker does with a request (module docstring).
ROLES = ("both", "prefill", "decode")
#: The most data-parallel ranks one worker may declare.
MAX_DP_SIZE = 1024
_SEPARATORS = re.compile(r"[,;\s]+")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker as configured (module docstring for the keys)."""

    url: str
    engine: str = "kvroute"
    events: str | None = None
    replay: str | None = None
    block_size: int | None = None
    dp_size: int | None = None
    role: str = "both"
    bootstrap_port: int | None = None
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"worker {self.url!r} is not an http(s) URL")
        _check_url(self.url)
        if self.engine not in ENGINES:
            raise ValueError(f"worker {self.url}: engine {self.engine!r} is not one of "
                             f"{', '.join(ENGINES)}")
        for name in ("events", "replay"):
            endpoint = getattr(self, name)
            if endpoint is not None and not re.fullmatch(r"(tcp|ipc|inproc)://\S+", endpoint):
                raise ValueError(f"worker {self.url}: {name} {endpoint!r} is not a ZeroMQ "
                                 "endpoint such as tcp://host:5557")
        if self.replay is not None and self.events is None:
            raise ValueError(f"worker {self.url}: a replay endpoint needs an events endpoint")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"worker {self.url}: block_size {self.block_size} is not positive")
        if self.role not in ROLES:
            raise ValueError(f"worker {self.url}: role {self.role!r} is not one of "
                             f"{', '.join(ROLES)}")
        if self.dp_size is not None and not 1 <= self.dp_size <= MAX_DP_SIZE:
            raise ValueError(f"worker {self.url}: dp_size {self.dp_size} is not in "
                             f"1..{MAX_DP_SIZE}")
        if self.bootstrap_port is not None and not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"worker {self.url}: bootstrap_port {self.bootstrap_port} is not "
                             "in 1..65535")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError(f"worker {self.url}: max_num_seqs {self.max_num_seqs} is not "
                             "positive")
        if self.engine == "kvroute" and self.max_num_seqs is not None:
            raise ValueError(f"worker {self.url}: a kvroute worker says its max_num_seqs at "
                             "/model_info; give it to the worker instead")
        if self.engine == "kvroute" and (self.events or self.replay or self.block_size):
            raise ValueError(f"worker {self.url}: a kvroute worker describes its own events "
                             "and block size at /model_info; give them to the worker instead")


def parse_worker(value: Any) -> WorkerConfig:
    """Read one worker from a table (config file, ``POST /workers``) or its flat text form.

    Raises:
        ValueError: an unknown key, a malformed value, or a missing URL; the message names it.
    """
    if isinstance(value, WorkerConfig):
        return value
    if isinstance(value, str):
        found = parse_workers(value)
        if len(found) != 1:
            raise ValueError(f"{value!r} names {len(found)} workers, not one")
        return found[0]
    if not isinstance(value, dict):
        raise ValueError(f"a worker is a URL or a table of {', '.join(_KEYS)}; got "
                         f"{type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"worker {value.get('url')!r}: unknown keys {unknown} (known: "
                         f"{', '.join(_KEYS)})")
    url = value.get("url")
    if type(url) is not str:
        raise ValueError("a worker needs a url (a string such as \"http://host:8000\")")
    fields: dict[str, Any] = {"url": url.rstrip("/")}
    for name in ("engine", "events", "replay", "role"):
        if value.get(name) is not None:
            if type(value[name]) is not str:
                raise ValueError(f"worker {url}: {name} must be a string")
            fields[name] = value[name]
    if value.get("block_size") is not None:
        fields["block_size"] = _integer(value["block_size"], "block_size", url)
    if value.get("dp_size") is not None:
        fields["dp_size"] = _integer(value["dp_size"], "dp_size", url)
    if value.get("bootstrap_port") is not None:
        fields["bootstrap_port"] = _integer(value["bootstrap_port"], "bootstrap_port", url)
    if value.get("max_num_seqs") is not None:
        fields["max_num_seqs"] = _integer(value["max_num_seqs"], "max_num_seqs", url)
    return WorkerConfig(**fields)


def parse_workers(value: Any) -> tuple[WorkerConfig, ...]:
    """Read a list of workers: a flat text form, or a list of tables, URLs or text forms.

    Raises:
        ValueError: any worker is malformed (see :func:`parse_worker`).
    """
    if isinstance(value, list | tuple):
        out: list[WorkerConfig] = []
        for item in value:
            if isinstance(item, str) and not item.strip():  # ``--worker ''``
                raise ValueError("a worker entry is empty")
            out.extend(parse_workers(item) if isinstance(item, str) else [parse_worker(item)])
        return tuple(out)
    if not isinstance(value, str):
        raise ValueError(f"workers must be text or a list; got {type(value).__name__}")
    tables: list[dict[str, Any]] = []
    for item in (p for p in _SEPARATORS.split(value) if p):
        if item.startswith(("http://", "https://")):
            tables.append({"url": item})
            continue
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"worker item {item!r} is not an http(s) URL nor key=value")
        if not tables:
            raise ValueError(f"worker option {item!r} comes before any worker URL")
        if key in tables[-1]:
            raise ValueError(f"worker {tables[-1]['url']}: {key} is given twice")
        tables[-1][key] = text
    return tuple(parse_worker(t) for t in tables)


def _check_url(url: str) -> None:
    """Refuse a URL no HTTP client could open: unparsable, without a host, or with a port
    outside 1..65535 (each would otherwise fail deep inside the first request)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # an unclosed "[", a port that is not a number or too large
        reason = "its port is not in 1..65535" if "port" in str(exc).lower() else str(exc)
        raise ValueError(f"worker {url!r} is not a valid URL: {reason}") from None
    if not parts.hostname:
        raise ValueError(f"worker {url!r} has no host")
    if port == 0:
        raise ValueError(f"worker {url!r}: port 0 is not in 1..65535")


def format_worker(worker: WorkerConfig) -> str:
    """The flat text form of ``worker`` (parses back to an equal config)."""
    parts = [worker.url]
    parts += [f"{k}={v}" for k, v in asdict(worker).items()
              if k != "url" and v is not None and v != WorkerConfig.__dataclass_fields__[k].default]
    return ",".join(parts)


def _integer(value: Any, name: str, url: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"worker {url}: {name} must be an integer")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"worker {url}: {name} {value!r} is not an integer") from None
