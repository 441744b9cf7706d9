"""Workers found by watching EndpointSlices, against a fake Kubernetes API on 127.0.0.1.

The fake serves the two calls discovery makes: the list (``GET .../endpointslices``) and the
watch (``?watch=1``: one JSON event per line, ADDED/MODIFIED/DELETED, from the
resourceVersion asked for; ``410 Gone`` for one older than it keeps)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from indexer.index import PrefixIndex
from kvroute.up import free_port
from router.fleet.discovery import Discovery, parse_target
from router.fleet.facts import FleetFacts
from router.fleet.k8s_discovery import (
    DP_SIZE_LABEL,
    ROLE_LABEL,
    EndpointSliceWatch,
    K8sTarget,
    cluster_client,
)
from router.fleet.registry import Registry
from router.settings import RouterSettings, SettingsError, load_settings
from tests.support.eventually import eventually

NS = "inference"
SELECTOR = "app=kvroute-worker"
TARGET = f"k8s://{NS}/{SELECTOR}?port=http"


class FakeKubeApi:
    """EndpointSlices in one namespace, listed and watched as the API server does."""

    def __init__(self, *, gone_in_stream: bool = False) -> None:
        self.port = free_port()
        self.version = 100
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, dict[str, Any]]] = []
        self.oldest = 0  # a watch from a version below this one is answered 410
        self.gone_in_stream = gone_in_stream  # 410 as an ERROR event (as a real server does)
        self.lists = 0
        self.watch_versions: list[str] = []
        self.authorizations: set[str] = set()
        self._streams: dict[asyncio.Queue[str | None], str] = {}  # each watch's selector
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def streams(self) -> int:
        return len(self._streams)

    def put(self, name: str, endpoints: list[tuple[str, bool | None]],
            ports: list[tuple[str, int]] = (("http", 8000),),  # type: ignore[assignment]
            labels: dict[str, str] | None = None) -> None:
        """Add or change a slice (ADDED or MODIFIED)."""
        kind = "MODIFIED" if name in self.slices else "ADDED"
        obj = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": name, "namespace": NS,
                            "labels": labels or {"app": "kvroute-worker"}},
               "addressType": "IPv4",
               "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
               "endpoints": [{"addresses": [a], "conditions": {} if r is None else {"ready": r}}
                             for a, r in endpoints]}
        self.slices[name] = obj
        self._event(kind, obj)

    def delete(self, name: str) -> None:
        self._event("DELETED", self.slices.pop(name))

    def forget(self, name: str) -> None:
        """Delete a slice and every version up to now, as an etcd compaction would: a watch
        from before now gets 410 and never hears of the deletion."""
        self.slices.pop(name)
        self.version += 1
        self.oldest = self.version
        self.history.clear()

    def send_raw(self, line: str) -> None:
        """Write one line to every open watch."""
        for queue in self._streams:
            queue.put_nowait(line)

    def drop(self) -> None:
        """End every open watch."""
        for queue in self._streams:
            queue.put_nowait(None)

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        event = {"type": kind, "object": json.loads(json.dumps(obj))}
        self.history.append((self.version, event))
        for queue, selector in self._streams.items():
            if self._matches(obj, selector):
                queue.put_nowait(json.dumps(event))

    def _matches(self, obj: dict[str, Any], selector: str) -> bool:
        labels = obj["metadata"]["labels"]
        return all(labels.get(k) == v for k, v in (t.split("=", 1) for t in selector.split(",")))

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        self.authorizations.add(request.headers.get("Authorization", ""))
        selector = request.query["labelSelector"]
        if request.query.get("watch") not in ("1", "true"):
            self.lists += 1
            items = [s for s in self.slices.values() if self._matches(s, selector)]
            return web.json_response({"kind": "EndpointSliceList", "items": items,
                                      "metadata": {"resourceVersion": str(self.version)}})
        version = request.query["resourceVersion"]
        self.watch_versions.append(version)
        gone = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410,
                "message": f"too old resource version: {version} ({self.oldest})"}
        if int(version) < self.oldest and not self.gone_in_stream:
            return web.json_response(gone, status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if int(version) < self.oldest:
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return response
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        for event_version, event in self.history:
            if event_version > int(version) and self._matches(event["object"], selector):
                queue.put_nowait(json.dumps(event))
        self._streams[queue] = selector
        try:
            while (line := await queue.get()) is not None:
                await response.write(line.encode() + b"\n")
        finally:
            del self._streams[queue]
        return response

    async def __aenter__(self) -> FakeKubeApi:
        app = web.Application()
        app.router.add_get(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
                           self._endpointslices)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.drop()
        assert self._runner is not None
        await self._runner.cleanup()


def _unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def registry(settings: RouterSettings | None = None) -> Registry:
    """A real registry whose workers never answer (no sockets: a refusing transport)."""
    settings = settings or RouterSettings()
    return Registry(settings.fleet_settings(), PrefixIndex(settings.block_size), FleetFacts(),
                    "bytes-v1", httpx.AsyncClient(transport=httpx.MockTransport(_unreachable)))


def urls(reg: Registry) -> set[str]:
    return {e.url for e in reg.entries()}


def kubeconfig(path: Path, server: str, token: str = "t0ken") -> Path:
    """A kubeconfig naming ``server`` with a bearer token (YAML is a superset of JSON)."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "kvroute", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "kvroute"}}]}))
    return path


@contextlib.asynccontextmanager
async def watching(api: FakeKubeApi, reg: Registry, target: str = TARGET):
    discovery = Discovery([target], 5.0, reg, k8s_backoff=(0.001, 0.01))
    await discovery.start()
    try:
        yield discovery
    finally:
        await discovery.stop()


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Point the default client at a fake through a kubeconfig (no service account here)."""
    def use(api: FakeKubeApi) -> None:
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", api.url)))
    return use


def test_targets_are_parsed_and_bad_ones_refused() -> None:
    assert parse_target(TARGET) == K8sTarget(NS, SELECTOR, "http")
    assert parse_target("k8s://ns/app=a,tier in (x,y)") == K8sTarget("ns", "app=a,tier in (x,y)")
    assert str(K8sTarget(NS, SELECTOR, "http")) == TARGET
    for bad in ("k8s://Inference/app=a", f"k8s://{NS}/", f"k8s://{NS}", "k8s:///app=a",
                f"k8s://{NS}/app=a?port=http&x=1", f"k8s://{NS}/app=a?port=Http"):
        with pytest.raises(ValueError, match=r"k8s://NAMESPACE/LABEL-SELECTOR|port name"):
            parse_target(bad)


def test_settings_read_kubernetes_targets_and_refuse_bad_ones_in_one_line() -> None:
    s = load_settings({}, env={"KVROUTE_DISCOVER": f"{TARGET}, dns:///b:9, k8s://ns/a=1,b=2"})
    assert s.discover == (TARGET, "dns:///b:9", "k8s://ns/a=1,b=2")
    with pytest.raises(SettingsError) as error:
        load_settings({"discover": ["k8s://ns"]}, env={})
    assert "\n" not in str(error.value) and "k8s://NAMESPACE/LABEL-SELECTOR" in str(error.value)


async def test_ready_endpoints_join_and_not_ready_or_deleted_ones_leave(cluster: Any) -> None:
    reg = registry()
    async with FakeKubeApi() as api:
        cluster(api)
        api.put("workers-a", [("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.9", None)],
                ports=[("metrics", 9100), ("http", 8000)])
        api.put("other", [("10.9.9.9", True)], labels={"app": "something-else"})
        async with watching(api, reg) as discovery:
            await eventually(lambda: urls(reg), "the listed ready endpoints joined",
                             until=lambda u: u == {"http://10.0.0.1:8000",
                                                   "http://10.0.0.9:8000"})
            assert api.authorizations == {"Bearer t0ken"}  # the kubeconfig's user
            await eventually(lambda: api.streams, "the watch is open")
            api.put("workers-b", [("10.0.0.3", True)])
            api.put("workers-a", [("10.0.0.1", False), ("10.0.0.2", True), ("10.0.0.9", None)],
                    ports=[("metrics", 9100), ("http", 8000)])
            await eventually(lambda: urls(reg), "a new slice joined, a not-ready one left",
                             until=lambda u: u == {"http://10.0.0.2:8000", "http://10.0.0.3:8000",
                                                   "http://10.0.0.9:8000"})
            api.delete("workers-b")
            await eventually(lambda: urls(reg), "the deleted slice's worker left",
                             until=lambda u: u == {"http://10.0.0.2:8000",
                                                   "http://10.0.0.9:8000"})
            assert discovery.urls == urls(reg)
            assert discovery.watches[0].bad_events == 0


async def test_a_dropped_watch_resumes_from_its_version_and_garbage_is_skipped(
        cluster: Any) -> None:
    reg = registry()
    async with FakeKubeApi() as api:
        cluster(api)
        api.put("workers-a", [("10.0.0.1", True)])
        async with watching(api, reg) as discovery:
            watch = discovery.watches[0]
            await eventually(lambda: api.streams, "the watch is open")
            api.send_raw("this is not json")
            api.send_raw(json.dumps({"type": "ADDED"}))  # no object
            api.send_raw(json.dumps({"type": "MODIFIED", "object": {"metadata": 5}}))
            api.send_raw(json.dumps({"type": "ADDED", "object": {"metadata": {
                "name": "x", "resourceVersion": "1"}, "addressType": "IPv4", "ports": "http",
                "endpoints": [{"addresses": "10.0.0.7", "conditions": []}, 3]}}))
            api.put("workers-b", [("10.0.0.2", True)])  # the watch goes on after garbage
            await eventually(lambda: urls(reg), "a slice after the garbage joined",
                             until=lambda u: "http://10.0.0.2:8000" in u)
            assert watch.bad_events == 3  # the slice with malformed fields is one with no port
            assert "http://10.0.0.7:8000" not in urls(reg)
            assert len(api.watch_versions) == 1
            seen = watch.resource_version
            api.drop()
            await eventually(lambda: len(api.watch_versions), "the watch reconnected",
                             until=lambda n: n >= 2)
            assert api.watch_versions[1] == seen  # resumed, not listed again
            assert api.lists == 1
            await eventually(lambda: api.streams, "the watch is open again")
            api.put("workers-c", [("10.0.0.3", True)])
            await eventually(lambda: urls(reg), "a slice after the reconnect joined",
                             until=lambda u: u == {"http://10.0.0.1:8000", "http://10.0.0.2:8000",
                                                   "http://10.0.0.3:8000"})


@pytest.mark.parametrize("in_stream", [False, True], ids=["http-410", "error-event-410"])
async def test_a_stale_version_lists_again_and_what_it_missed_leaves(
        cluster: Any, in_stream: bool) -> None:
    reg = registry()
    async with FakeKubeApi(gone_in_stream=in_stream) as api:
        cluster(api)
        api.put("workers-a", [("10.0.0.1", True)])
        api.put("workers-b", [("10.0.0.2", True)])
        async with watching(api, reg) as discovery:
            await eventually(lambda: api.streams, "the watch is open")
            assert len(urls(reg)) == 2
            api.forget("workers-b")  # its deletion is compacted away
            api.drop()
            await eventually(lambda: api.lists, "listed again after 410", until=lambda n: n >= 2)
            await eventually(lambda: urls(reg), "the missed deletion took effect",
                             until=lambda u: u == {"http://10.0.0.1:8000"})
            assert discovery.watches[0].lists >= 2


async def test_a_slice_without_the_named_port_gives_no_workers(cluster: Any) -> None:
    reg = registry()
    async with FakeKubeApi() as api:
        cluster(api)
        api.put("wrong-port", [("10.0.0.5", True)], ports=[("grpc", 9000)])
        api.put("right-port", [("10.0.0.6", True)])
        async with watching(api, reg):
            await eventually(lambda: urls(reg), "the slice with the port joined",
                             until=lambda u: u == {"http://10.0.0.6:8000"})
        async with watching(api, registry(), f"k8s://{NS}/{SELECTOR}") as d:  # the only port
            await eventually(lambda: d.urls, "each slice's only port is used",
                             until=lambda u: u == {"http://10.0.0.5:9000",
                                                   "http://10.0.0.6:8000"})


async def test_endpoints_are_capped_per_target(cluster: Any) -> None:
    async with FakeKubeApi() as api:
        cluster(api)
        api.put("big", [(f"10.0.1.{i}", True) for i in range(1, 21)])
        reg = registry()
        discovery = Discovery([TARGET], 5.0, reg, k8s_backoff=(0.001, 0.01))
        await discovery.start()
        try:
            discovery.watches[0].max_endpoints = 5
            api.put("big2", [("10.0.2.1", True)])
            await eventually(lambda: api.lists, "listed")
            await eventually(lambda: discovery.watches[0].resource_version, "the event came",
                             until=lambda v: v == str(api.version))
            assert len(urls(reg)) == 5
        finally:
            await discovery.stop()


async def test_no_cluster_configuration_is_one_logged_line_and_nothing_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="no Kubernetes configuration") as error:
        cluster_client(str(tmp_path / "no-account"))
    assert "\n" not in str(error.value)
    reg = registry()
    discovery = Discovery([TARGET, "dns:///localhost:8000"], 5.0, reg)
    await discovery.start()
    await discovery.stop()
    assert "not watching k8s://inference/app=kvroute-worker?port=http" in caplog.text
    assert urls(reg)  # the DNS target still found its workers


async def test_in_cluster_configuration_comes_from_the_service_account(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = next((p for p in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/cert.pem")
                   if Path(p).exists()), None)
    if bundle is None:
        pytest.skip("no system CA bundle to stand in for the cluster's CA")
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token")
    (account / "namespace").write_text(NS)
    shutil.copy(bundle, account / "ca.crt")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    client = cluster_client(str(account))
    try:
        assert str(client.base_url).rstrip("/") == "https://10.96.0.1:6443"
        request = next(client.auth.auth_flow(client.build_request("GET", "/api")))
        assert request.headers["Authorization"] == "Bearer pod-token"
    finally:
        await client.aclose()


async def test_the_registry_watches_the_targets_its_settings_name(cluster: Any) -> None:
    async with FakeKubeApi() as api:
        cluster(api)
        api.put("workers-a", [("10.0.0.1", True)])
        reg = registry(load_settings({"discover": [TARGET]}, env={}))
        await reg.start()
        try:
            await eventually(lambda: urls(reg), "the slice's worker joined",
                             until=lambda u: u == {"http://10.0.0.1:8000"})
            await eventually(lambda: api.streams, "the watch is open")
            api.put("workers-a", [("10.0.0.1", False)])
            await eventually(lambda: urls(reg), "the not-ready worker left", until=lambda u: not u)
        finally:
            await reg.stop()
        assert reg.discovery is not None and reg.discovery.watches[0].lists == 1


async def test_reconnects_back_off_doubling_up_to_the_cap() -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 9:
            raise asyncio.CancelledError

    async def apply(found: dict[str, Any]) -> None:
        raise AssertionError("nothing was listed")

    port = free_port()  # nothing listens there
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        watch = EndpointSliceWatch(K8sTarget(NS, SELECTOR, "http"), apply, client,
                                   sleep=sleep)
        with pytest.raises(asyncio.CancelledError):
            await watch.run()
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert watch.lists == 0 and watch.watches == 0


async def test_slice_labels_give_roles_and_ranks_and_malformed_ones_no_workers(
        cluster: Any) -> None:
    reg = registry()

    def topology() -> set[tuple[str, str, int]]:
        return {(e.url, e.role, e.dp_size) for e in reg.entries()}

    app = {"app": "kvroute-worker"}
    async with FakeKubeApi() as api:
        cluster(api)
        api.put("prefill", [("10.0.0.1", True)], labels={**app, ROLE_LABEL: "prefill",
                                                         DP_SIZE_LABEL: "2"})
        api.put("decode", [("10.0.0.2", True)], labels={**app, ROLE_LABEL: "decode"})
        api.put("plain", [("10.0.0.3", True)])
        api.put("typo", [("10.0.0.4", True)], labels={**app, ROLE_LABEL: "prefil"})
        api.put("zero", [("10.0.0.5", True)], labels={**app, DP_SIZE_LABEL: "0"})
        async with watching(api, reg) as discovery:
            await eventually(topology, "the labelled slices' workers joined in their roles",
                             until=lambda t: t == {("http://10.0.0.1:8000", "prefill", 2),
                                                   ("http://10.0.0.2:8000", "decode", 1),
                                                   ("http://10.0.0.3:8000", "both", 1)})
            await eventually(lambda: api.streams, "the watch is open")
            # A Service relabelled: its worker leaves and joins again in its new role.
            old = reg.find("http://10.0.0.2:8000").id
            api.put("decode", [("10.0.0.2", True)], labels={**app, ROLE_LABEL: "both"})
            await eventually(topology, "the relabelled worker is registered anew",
                             until=lambda t: ("http://10.0.0.2:8000", "both", 1) in t)
            assert reg.find("http://10.0.0.2:8000").id != old
            # The malformed ones gave none, and were not counted as bad events.
            assert discovery.urls == {f"http://10.0.0.{i}:8000" for i in (1, 2, 3)}
            assert discovery.watches[0].bad_events == 0
