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
from urllib.parse import urlsplit

from router.fleet.k8s_discovery import (
    EndpointSliceWatch,
    K8sTarget,
    cluster_client,
    parse_k8s_target,
)
from router.fleet.worker_table import IncompatibleWorker

__all__ = ["Discovery", "DnsTarget", "K8sTarget", "Membership", "Resolver", "parse_target",
           "system_resolver"]

log = logging.getLogger(__name__)

#: ``resolve(host, port)`` -> the addresses ``host`` has now (an empty list: no such name).
#: Raises ``OSError`` when the look-up itself failed.
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """A DNS name whose addresses are workers on ``port``."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"dns:///{self.host}:{self.port}"


def parse_target(text: str) -> DnsTarget | K8sTarget:
    """Parse ``dns:///NAME:PORT`` (gRPC's DNS target form, without a DNS server authority)
    or ``k8s://NAMESPACE/LABEL-SELECTOR[?port=NAME]``.

    Raises:
        ValueError: not of either form, or the port is out of range.
    """
    if text.startswith("k8s:"):
        return parse_k8s_target(text)
    parts = urlsplit(text)
    if parts.scheme != "dns" or parts.netloc or not parts.path.startswith("/"):
        raise ValueError(f"{text!r} is not dns:///NAME:PORT")
    try:
        name = urlsplit(f"//{parts.path.lstrip('/')}")
        port = name.port
    except ValueError:
        port = None
    if not name.hostname or port is None or not 0 < port < 65536:
        raise ValueError(f"{text!r} is not dns:///NAME:PORT (a port in 1..65535 is needed)")
    return DnsTarget(name.hostname, port)


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

    async def add(self, url: str, *, must_answer: bool = True) -> object: ...

    async def remove(self, worker: int) -> object: ...

    def find(self, url: str) -> object | None: ...


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
        self._found: dict[DnsTarget | K8sTarget, set[str]] = {t: set() for t in parsed}
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
        return set().union(*self._found.values())

    async def refresh(self) -> None:
        """Resolve every target once and add or remove workers to match."""
        for target in self.targets:
            try:
                addresses = await self._resolve(target.host, target.port)
            except OSError as exc:
                log.warning("cannot resolve %s (keeping %d workers): %s", target,
                            len(self._found[target]), exc)
                continue
            wanted = set()
            for address in addresses:
                try:
                    wanted.add(worker_url(address, target.port))
                except ValueError:
                    log.warning("%s resolved to %r, not an IP address: skipped", target, address)
            await self._apply(target, wanted)

    async def _apply(self, target: DnsTarget | K8sTarget, wanted: set[str]) -> None:
        async with self._lock:  # DNS refreshes and watches run side by side
            await self._apply_locked(target, wanted)

    async def _apply_locked(self, target: DnsTarget | K8sTarget, wanted: set[str]) -> None:
        held = self._found[target]
        others = set().union(*(v for k, v in self._found.items() if k != target))
        for url in sorted(held - wanted):
            held.discard(url)
            if url in others:  # the same address under another name stays
                continue
            worker = self._ids.pop(url, None)
            if worker is None:  # configured with --worker, or refused: not ours to remove
                continue
            log.info("worker %s left %s", url, target)
            with contextlib.suppress(KeyError):
                await self._registry.remove(worker)
        for url in sorted(wanted - held):
            held.add(url)
            if url in self._ids:
                continue
            if self._registry.find(url) is not None:  # also configured with --worker
                continue
            try:
                entry = await self._registry.add(url, must_answer=False)
            except (IncompatibleWorker, ValueError) as exc:  # not retried until it rejoins
                log.error("not routing to %s from %s: %s", url, target, exc)
                continue
            self._ids[url] = entry.id  # type: ignore[attr-defined]
            log.info("worker %s joined %s", url, target)

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
