"""Discovered workers: by DNS, one worker per address a name resolves to, kept in step (and by
watching Kubernetes EndpointSlices, below).

A Kubernetes headless Service resolves to the addresses of its ready pods; pointing
``--discover dns:///kvroute-workers.NAMESPACE.svc.cluster.local:8000`` at it makes every pod
a worker (``http://ADDRESS:8000``) for as long as its address is in the answer. The name is
resolved at start and every ``discover_interval`` seconds:

- an address that appears is registered (unreachable ones are kept and retried, as
  configured workers are);
- an address that is gone is unregistered (its entries and load go with it);
- a look-up that fails for any reason but "no such name" changes nothing: a DNS outage must
  not empty the pool. "No such name" (a headless Service with no ready pod) is an answer:
  every worker it gave before goes.

Only workers this module registered are ever removed by it; ``--worker`` ones are left alone.

The target's query gives its workers a topology: ``dns:///prefill.NS.svc:8000?role=prefill``
(``prefill``, ``decode`` or ``both``, the default) and ``&dp_size=2`` (data-parallel ranks
behind each address), the keys of a configured worker (:mod:`router.fleet.worker_config`).
A worker whose topology changes (its labels, for ``k8s://``) is registered anew.

``k8s://NAMESPACE/LABEL-SELECTOR`` targets watch EndpointSlices instead
(router.fleet.k8s_discovery); their workers join and leave through the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit

from router.fleet.k8s_discovery import (
    EndpointSliceWatch,
    K8sTarget,
    cluster_client,
    parse_k8s_target,
)
from router.fleet.worker_config import MAX_DP_SIZE, ROLES, WorkerConfig
from router.fleet.worker_table import IncompatibleWorker

__all__ = ["Discovery", "DnsTarget", "K8sTarget", "Membership", "Resolver", "parse_target",
           "system_resolver"]

log = logging.getLogger(__name__)

#: ``resolve(host, port)`` -> the addresses ``host`` has now (an empty list: no such name).
#: Raises ``OSError`` when the look-up itself failed.
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """A DNS name whose addresses are workers on ``port``, in ``role`` with ``dp_size``
    ranks each (``None``: what the engine reports)."""

    host: str
    port: int
    role: str = "both"
    dp_size: int | None = None

    def __str__(self) -> str:
        query = "&".join(([f"role={self.role}"] if self.role != "both" else [])
                         + ([f"dp_size={self.dp_size}"] if self.dp_size is not None else []))
        return f"dns:///{self.host}:{self.port}" + (f"?{query}" if query else "")


def parse_target(text: str) -> DnsTarget | K8sTarget:
    """Parse ``dns:///NAME:PORT[?role=ROLE&dp_size=N]`` (gRPC's DNS target form, without a
    DNS server authority) or ``k8s://NAMESPACE/LABEL-SELECTOR[?port=NAME]``.

    Raises:
        ValueError: not of either form, the port is out of range, or the query names an
            unknown key or a bad value.
    """
    if text.startswith("k8s:"):
        return parse_k8s_target(text)
    parts = urlsplit(text)
    if parts.scheme != "dns" or parts.netloc or not parts.path.startswith("/") \
            or parts.fragment:
        raise ValueError(f"{text!r} is not {DNS_FORM}")
    try:
        name = urlsplit(f"//{parts.path.lstrip('/')}")
        port = name.port
    except ValueError:
        port = None
    if not name.hostname or port is None or not 0 < port < 65536:
        raise ValueError(f"{text!r} is not {DNS_FORM} (a port in 1..65535 is needed)")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = dict(pairs)
    if set(query) - {"role", "dp_size"} or len(query) != len(pairs):
        raise ValueError(f"{text!r} is not {DNS_FORM} (the options are role and dp_size, "
                         "each once)")
    role = query.get("role", "both")
    if role not in ROLES:
        raise ValueError(f"{text!r}: role {role!r} is not one of {', '.join(ROLES)}")
    size = query.get("dp_size")
    if size is not None and not (size.isdigit() and 1 <= int(size) <= MAX_DP_SIZE):
        raise ValueError(f"{text!r}: dp_size {size!r} is not in 1..{MAX_DP_SIZE}")
    return DnsTarget(name.hostname, port, role, None if size is None else int(size))


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to through the system resolver, sorted.

    Raises:
        OSError: the look-up failed (not "no such name", which returns ``[]``).
    """
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise
    except UnicodeError as exc:  # a label the IDNA codec refuses
        raise OSError(f"{host!r} is not a valid DNS name: {exc}") from None
    return sorted({str(info[4][0]) for info in infos})


class Membership(Protocol):
    """What discovery needs of the registry."""

    async def add(self, worker: WorkerConfig, *, must_answer: bool = True) -> object: ...

    async def remove(self, worker: int) -> object: ...

    def find(self, url: str) -> object | None: ...


DNS_FORM = "dns:///NAME:PORT[?role=ROLE&dp_size=N]"


def worker_url(address: str, port: int) -> str:
    """The worker URL for one resolved address."""
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


#: ``make_client()`` -> an async HTTP client for the Kubernetes API server.
ClientFactory = Callable[[], Any]


class Discovery:
    """Keeps the registry's discovered workers equal to what the DNS names resolve to and
    what the Kubernetes EndpointSlices hold.

    Args:
        targets: ``dns:///NAME:PORT`` and ``k8s://NAMESPACE/SELECTOR`` strings.
        interval: seconds between DNS look-ups.
        registry: where workers are added and removed.
        resolver: the look-up (the system's by default; tests pass a stub).
        k8s_client: makes the API server's client (from the pod's service account or a
            kubeconfig by default; tests point one at a fake).
        k8s_backoff: (first, most) seconds before a dropped watch reconnects.
    """

    def __init__(self, targets: Sequence[str], interval: float, registry: Membership,
                 resolver: Resolver = system_resolver, *,
                 k8s_client: ClientFactory = cluster_client,
                 k8s_backoff: tuple[float, float] = (0.5, 30.0)) -> None:
        parsed = [parse_target(t) for t in targets]
        #: The ``dns:///`` targets, resolved every ``interval`` seconds.
        self.targets = [t for t in parsed if isinstance(t, DnsTarget)]
        self.interval = interval
        self._registry = registry
        self._resolve = resolver
        #: Each target's workers now, by URL.
        self._found: dict[DnsTarget | K8sTarget, dict[str, WorkerConfig]] = {
            t: {} for t in parsed}
        self._ids: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._k8s_targets = [t for t in parsed if isinstance(t, K8sTarget)]
        self._k8s_client = k8s_client
        self._k8s_backoff = k8s_backoff
        #: One watch per ``k8s://`` target, from :meth:`start` on.
        self.watches: list[EndpointSliceWatch] = []
        self._watch_tasks: list[asyncio.Task[None]] = []
        self._client: Any = None

    @property
    def urls(self) -> set[str]:
        """The worker URLs discovery holds now."""
        return set().union(*(found.keys() for found in self._found.values()))

    async def refresh(self) -> None:
        """Resolve every target once and add or remove workers to match."""
        for target in self.targets:
            try:
                addresses = await self._resolve(target.host, target.port)
            except OSError as exc:
                log.warning("cannot resolve %s (keeping %d workers): %s", target,
                            len(self._found[target]), exc)
                continue
            wanted = {}
            for address in addresses:
                try:
                    url = worker_url(address, target.port)
                    wanted[url] = WorkerConfig(url, role=target.role, dp_size=target.dp_size)
                except ValueError:
                    log.warning("%s resolved to %r, not an IP address: skipped", target, address)
            await self._apply(target, wanted)

    async def _apply(self, target: DnsTarget | K8sTarget, wanted: dict[str, WorkerConfig]
                     ) -> None:
        async with self._lock:  # DNS refreshes and watches run side by side
            await self._apply_locked(target, wanted)

    async def _apply_locked(self, target: DnsTarget | K8sTarget,
                            wanted: dict[str, WorkerConfig]) -> None:
        held = self._found[target]
        others = set().union(*(v.keys() for k, v in self._found.items() if k != target))
        # A worker whose topology changed leaves and joins again in its new role.
        changed = {url for url in held.keys() & wanted.keys() if held[url] != wanted[url]}
        for url in sorted(held.keys() - wanted.keys() | changed):
            del held[url]
            if url in others:  # the same address under another name stays
                continue
            worker = self._ids.pop(url, None)
            if worker is None:  # configured with --worker, or refused: not ours to remove
                continue
            log.info("worker %s left %s", url, target)
            with contextlib.suppress(KeyError):
                await self._registry.remove(worker)
        for url in sorted(wanted.keys() - held.keys()):
            held[url] = wanted[url]
            if url in self._ids:
                continue
            if self._registry.find(url) is not None:  # also configured with --worker
                continue
            try:
                entry = await self._registry.add(wanted[url], must_answer=False)
            except (IncompatibleWorker, ValueError) as exc:  # not retried until it rejoins
                log.error("not routing to %s from %s: %s", url, target, exc)
                continue
            self._ids[url] = entry.id  # type: ignore[attr-defined]
            log.info("worker %s joined %s as %s", url, target, wanted[url].role)

    async def start(self) -> None:
        """Resolve once now, then keep resolving in the background until :meth:`stop`;
        start watching every ``k8s://`` target (with no cluster configuration: an error
        logged, and the router goes on with its other workers)."""
        if self._k8s_targets:
            try:
                self._client = self._k8s_client()
            except RuntimeError as exc:
                log.error("not watching %s: %s", ", ".join(map(str, self._k8s_targets)), exc)
        if self._client is not None:
            for target in self._k8s_targets:
                watch = EndpointSliceWatch(target, functools.partial(self._apply, target),
                                           self._client, backoff=self._k8s_backoff)
                self.watches.append(watch)
                self._watch_tasks.append(asyncio.create_task(
                    watch.run(), name=f"kvroute-discovery-{target.namespace}"))
        if self.targets:
            await self.refresh()
            self._task = asyncio.create_task(self._run(), name="kvroute-discovery")

    async def stop(self) -> None:
        """Stop resolving and watching (the workers found stay registered)."""
        tasks = [*self._watch_tasks, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        self._watch_tasks = []
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a bug here must not end discovery for good
                log.exception("worker discovery failed; retrying in %.1fs", self.interval)
