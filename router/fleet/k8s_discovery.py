"""Workers found by watching Kubernetes EndpointSlices (``k8s://NAMESPACE/SELECTOR``).

``--discover k8s://inference/app=kvroute-worker?port=http`` lists the EndpointSlices
(``discovery.k8s.io/v1``) in namespace ``inference`` whose labels match the selector, then
watches them. Every ready endpoint (``conditions.ready`` true or unset, as the API defines it)
is a worker at ``http://ADDRESS:PORT``; one that turns not-ready, or whose slice is deleted,
leaves. The port is the slice port named by ``?port=NAME``, or the slice's only port.

A slice's labels may give its workers a topology: ``kvroute.io/role`` (``prefill``,
``decode`` or ``both``, the default) and ``kvroute.io/dp-size`` (data-parallel ranks behind
each endpoint). The EndpointSlice controller copies a Service's labels onto its slices, so
they are set on the Service (one Service per role). A slice whose labels are malformed gives
no workers, with a warning, rather than workers in the wrong role.

- The cluster is found as ``kubectl`` finds it: the pod's service account
  (``/var/run/secrets/kubernetes.io/serviceaccount`` with ``KUBERNETES_SERVICE_HOST`` and
  ``_PORT``), else ``$KUBECONFIG``, else ``~/.kube/config`` (lightkube reads them).
- A watch that drops is resumed from the last ``resourceVersion`` seen, after a backoff that
  doubles per failed attempt (``base`` to ``cap`` seconds); a ``410 Gone`` (that version is
  no longer kept) lists again from scratch, and workers missing from the new list leave.
- A line of the watch that is not a well-formed event is counted (``bad_events``) and
  skipped; the watch goes on.
- At most ``max_endpoints`` workers and as many slices are held per target; the rest are
  dropped with a warning, so a runaway selector cannot grow memory without bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from router.fleet.worker_config import MAX_DP_SIZE, ROLES, WorkerConfig

__all__ = ["DP_SIZE_LABEL", "ROLE_LABEL", "EndpointSliceWatch", "K8sTarget", "cluster_client",
           "parse_k8s_target"]

log = logging.getLogger(__name__)

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
FORM = "k8s://NAMESPACE/LABEL-SELECTOR[?port=NAME]"
#: The slice (Service) labels that give its workers a role and data-parallel ranks.
ROLE_LABEL = "kvroute.io/role"
DP_SIZE_LABEL = "kvroute.io/dp-size"

#: ``apply(workers)``: make the target's workers exactly ``workers`` (URL -> configuration).
Apply = Callable[[dict[str, WorkerConfig]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class K8sTarget:
    """EndpointSlices in ``namespace`` matching ``selector``; workers on the port ``port``
    names (``None``: the slice's only port)."""

    namespace: str
    selector: str
    port: str | None = None

    def __str__(self) -> str:
        tail = f"?port={self.port}" if self.port else ""
        return f"k8s://{self.namespace}/{self.selector}{tail}"

    @property
    def path(self) -> str:
        """The API path of the target's EndpointSlices."""
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"


def parse_k8s_target(text: str) -> K8sTarget:
    """Parse ``k8s://NAMESPACE/LABEL-SELECTOR[?port=NAME]``.

    Raises:
        ValueError: not of that form (one line, naming the form).
    """
    parts = urlsplit(text)
    selector = parts.path[1:]
    if parts.scheme != "k8s" or not _NAMESPACE.fullmatch(parts.netloc) or not selector.strip():
        raise ValueError(f"{text!r} is not {FORM} (a namespace and a label selector are needed)")
    if parts.fragment:
        raise ValueError(f"{text!r} is not {FORM} (no '#' part)")
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(k != "port" for k, _ in query) or len(query) > 1:
        raise ValueError(f"{text!r} is not {FORM} (the only option is port=NAME)")
    port = query[0][1] if query else None
    if port is not None and not _PORT_NAME.fullmatch(port):
        raise ValueError(f"{text!r}: port {port!r} is not a port name (lowercase, digits, '-')")
    return K8sTarget(parts.netloc, selector, port)


def cluster_client(service_account: str | None = None) -> Any:
    """An HTTP client for the cluster's API server, configured as ``kubectl`` would be.

    Raises:
        RuntimeError: no cluster configuration was found (one line saying where it looked).
    """
    import httpx2
    from lightkube.config import client_adapter
    from lightkube.config.kubeconfig import SERVICE_ACCOUNT, KubeConfig
    from lightkube.core.exceptions import ConfigError

    try:
        config = KubeConfig.from_env(service_account=service_account or SERVICE_ACCOUNT)
        single = config.get()
        if single is None:
            raise ConfigError("it names no current context")
    except (ConfigError, OSError, KeyError, ValueError) as exc:
        raise RuntimeError(
            "no Kubernetes configuration: not in a pod with a service account "
            f"({service_account or SERVICE_ACCOUNT}), and no readable $KUBECONFIG or "
            f"~/.kube/config ({exc})") from None
    # Watches stay open up to the server's timeoutSeconds; a read timeout above that notices
    # a connection that died silently.
    params = client_adapter.ConnectionParams(
        timeout=httpx2.Timeout(10.0, read=WATCH_SECONDS + 30.0))
    return client_adapter.AsyncClient(single, params)


#: How long the API server keeps one watch request open before it ends it cleanly.
WATCH_SECONDS = 300


class Gone(Exception):
    """The resourceVersion is too old: list again."""


class WatchFailed(Exception):
    """The API server answered with an error."""


class EndpointSliceWatch:
    """Keeps one target's workers equal to the ready endpoints of its EndpointSlices.

    Args:
        target: what to watch.
        apply: called with every new set of worker URLs.
        client: an ``httpx``-like async client whose base URL is the API server.
        max_endpoints: most workers (and slices) held.
        backoff: (first, most) seconds to wait before reconnecting after a failure.
        sleep: how to wait (tests pass one that records).
    """

    def __init__(self, target: K8sTarget, apply: Apply, client: Any, *,
                 max_endpoints: int = 1024, backoff: tuple[float, float] = (0.5, 30.0),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.target = target
        self._apply = apply
        self._client = client
        self.max_endpoints = max_endpoints
        self.backoff = backoff
        self._sleep = sleep
        self._slices: dict[str, dict[str, WorkerConfig]] = {}
        self.resource_version: str | None = None
        #: Lines of the watch that were not a well-formed event, skipped.
        self.bad_events = 0
        #: Lists done (the first, then one per ``410 Gone``), and watch requests made.
        self.lists = 0
        self.watches = 0
        self._warned: set[str] = set()
        from router.fleet.discovery import worker_url  # that module imports this one
        self._url = worker_url

    @property
    def urls(self) -> set[str]:
        """The worker URLs the slices hold now (at most ``max_endpoints``)."""
        return set(self.workers)

    @property
    def workers(self) -> dict[str, WorkerConfig]:
        """The workers the slices hold now (at most ``max_endpoints``), by URL; an address in
        two slices takes the first slice's (by name) labels."""
        found: dict[str, WorkerConfig] = {}
        for name in sorted(self._slices):
            for url, config in self._slices[name].items():
                found.setdefault(url, config)
        if len(found) > self.max_endpoints:
            self._warn_once("cap", "%s: %d endpoints, keeping the first %d", self.target,
                            len(found), self.max_endpoints)
            found = {url: found[url] for url in sorted(found)[:self.max_endpoints]}
        return found

    async def run(self) -> None:
        """List, then watch, for ever: reconnect with backoff, list again after a 410."""
        failures = 0
        while True:
            try:
                if self.resource_version is None:
                    await self._list()
                if await self._watch():
                    failures = 0
                else:  # ended without one event: do not spin on a server that hangs up
                    failures += 1
            except Gone:
                log.info("%s: resourceVersion %s is gone; listing again", self.target,
                         self.resource_version)
                self.resource_version = None
                failures += 1
            except Exception as exc:  # the API server's errors, transport errors, bugs: retried
                failures += 1
                log.warning("%s: watch failed (keeping %d workers): %s: %s", self.target,
                            len(self.urls), type(exc).__name__, exc)
            first, most = self.backoff
            if failures:
                await self._sleep(min(most, first * 2 ** min(failures - 1, 16)))

    async def _list(self) -> None:
        slices: dict[str, dict[str, WorkerConfig]] = {}
        params: dict[str, Any] = {"labelSelector": self.target.selector, "limit": 500}
        version = None
        for _ in range(64):  # pages; 64 x 500 slices is far past max_endpoints
            response = await self._client.get(self.target.path, params=params)
            if response.status_code == 410:
                raise Gone()
            if response.status_code != 200:
                raise WatchFailed(f"list answered HTTP {response.status_code}: "
                                  f"{response.text[:200]}")
            body = response.json()
            if not isinstance(body, dict) or not isinstance(body.get("items"), list):
                raise ValueError("list answer has no items")
            for item in body["items"]:
                name, urls = self._slice(item)
                if name is not None and len(slices) < self.max_endpoints:
                    slices[name] = urls
            metadata = _metadata(body)
            version = metadata.get("resourceVersion")
            if not metadata.get("continue"):
                break
            params["continue"] = metadata["continue"]
        if not isinstance(version, str) or not version:
            raise ValueError("list answer has no resourceVersion")
        self.lists += 1
        self._slices = slices
        self.resource_version = version
        await self._apply(self.workers)

    async def _watch(self) -> bool:
        """One watch request; True when it brought at least one event."""
        params = {"labelSelector": self.target.selector, "watch": "1",
                  "resourceVersion": self.resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(WATCH_SECONDS)}
        self.watches += 1
        seen = False
        async with self._client.stream("GET", self.target.path, params=params) as response:
            if response.status_code == 410:
                raise Gone()
            if response.status_code != 200:
                await response.aread()
                raise WatchFailed(f"watch answered HTTP {response.status_code}: "
                                  f"{response.text[:200]}")
            async for line in response.aiter_lines():
                if line.strip():
                    seen = True
                    await self._event(line)
        return seen

    async def _event(self, line: str) -> None:
        try:
            event = json.loads(line)
            kind, obj = event["type"], event["object"]
            if not isinstance(obj, dict):
                raise TypeError("object is not a JSON object")
        except (ValueError, KeyError, TypeError) as exc:
            self.bad_events += 1
            log.warning("%s: skipped a watch line that is not an event (%s): %.120r",
                        self.target, exc, line)
            return
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise WatchFailed(f"watch error {obj.get('code')}: {obj.get('message')}")
        version = _metadata(obj).get("resourceVersion")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK") or not isinstance(
                version, str):
            self.bad_events += 1
            log.warning("%s: skipped a watch event of type %r without a resourceVersion",
                        self.target, kind)
            return
        self.resource_version = version
        if kind == "BOOKMARK":
            return
        name, urls = self._slice(obj)
        if name is None:
            self.bad_events += 1
            return
        if kind == "DELETED":
            self._slices.pop(name, None)
        elif name in self._slices or len(self._slices) < self.max_endpoints:
            self._slices[name] = urls
        else:
            self._warn_once("slices", "%s: more than %d slices; ignoring the rest",
                            self.target, self.max_endpoints)
            return
        await self._apply(self.workers)

    def _slice(self, obj: Any) -> tuple[str | None, dict[str, WorkerConfig]]:
        """A slice's name and its ready endpoints' workers by URL (``None``: not a slice)."""
        metadata = _metadata(obj)
        name = metadata.get("name")
        if not isinstance(name, str):
            log.warning("%s: skipped an EndpointSlice without a name", self.target)
            return None, {}
        if obj.get("addressType") not in ("IPv4", "IPv6"):
            return name, {}
        port = self._port(name, obj.get("ports"))
        topology = self._topology(name, metadata.get("labels"))
        if port is None or topology is None:
            return name, {}
        workers: dict[str, WorkerConfig] = {}
        for address in _ready_addresses(obj.get("endpoints")):
            try:
                url = self._url(address, port)
                workers[url] = WorkerConfig(url, **topology)
            except ValueError:
                log.warning("%s: slice %s has %r, not an IP address: skipped", self.target,
                            name, address)
            if len(workers) >= self.max_endpoints:
                break
        return name, workers

    def _topology(self, name: str, labels: Any) -> dict[str, Any] | None:
        """The role and data-parallel ranks a slice's labels give (``None``: malformed)."""
        labels = labels if isinstance(labels, dict) else {}
        role, size = labels.get(ROLE_LABEL, "both"), labels.get(DP_SIZE_LABEL)
        dp_size = int(size) if isinstance(size, str) and size.isdigit() else None
        if role not in ROLES or (size is not None and not 1 <= (dp_size or 0) <= MAX_DP_SIZE):
            self._warn_once(f"labels:{name}", "%s: slice %s: %s=%r is not one of %s, or %s=%r "
                            "is not in 1..%d: no workers from it", self.target, name,
                            ROLE_LABEL, role, "/".join(ROLES), DP_SIZE_LABEL, size, MAX_DP_SIZE)
            return None
        return {"role": role, "dp_size": dp_size}

    def _port(self, name: str, ports: Any) -> int | None:
        numbered = [p for p in ports if isinstance(p, dict) and isinstance(p.get("port"), int)
                    ] if isinstance(ports, list) else []
        if self.target.port is not None:
            chosen = [p["port"] for p in numbered if p.get("name") == self.target.port]
        else:
            chosen = [p["port"] for p in numbered] if len(numbered) == 1 else []
        if len(chosen) == 1 and 0 < chosen[0] < 65536:
            return int(chosen[0])
        wanted = f"a port named {self.target.port!r}" if self.target.port else "exactly one port"
        self._warn_once(f"port:{name}", "%s: slice %s has not %s (ports %s): no workers from it",
                        self.target, name, wanted, [p.get("name") for p in numbered])
        return None

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned and len(self._warned) < 256:
            self._warned.add(key)
            log.warning(message, *args)


def _metadata(obj: Any) -> dict[str, Any]:
    """``obj["metadata"]`` when both are JSON objects, else ``{}``."""
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def _ready_addresses(endpoints: Any) -> Iterator[str]:
    """The first address of every ready endpoint (the API: its addresses are fungible)."""
    for endpoint in endpoints if isinstance(endpoints, list) else []:
        if not isinstance(endpoint, dict):
            continue
        conditions = endpoint.get("conditions") or {}
        ready = conditions.get("ready") if isinstance(conditions, dict) else False
        addresses = endpoint.get("addresses")
        if ready is not False and isinstance(addresses, list) and addresses and isinstance(
                addresses[0], str):
            yield addresses[0]
