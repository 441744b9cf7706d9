"""The Kubernetes manifests, checked offline: every object against its schema (core kinds with
kubernetes-validate's bundled schemas, the Inference Extension, Gateway API and Prometheus
Operator objects with the schemas in deploy/k8s/schemas), and the wiring between them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.settings import load_settings
from workers.settings import load_worker_settings

pytestmark = pytest.mark.process  # starts child processes

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("sim", "torch")
SCHEMAS = {"inference.networking.k8s.io/v1": "inferencepool-v1.schema.json",
           "gateway.networking.k8s.io/v1": "gateway-api-v1.schema.json",
           "monitoring.coreos.com/v1": "podmonitor-v1.schema.json"}


def _kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def _files_named(folder: Path) -> list[Path]:
    """Every manifest file a kustomization names, resolving folders recursively."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    files: list[Path] = []
    for entry in kustomization.get("resources", []):
        path = (folder / entry).resolve()
        assert path.exists(), f"{folder}/kustomization.yaml names {entry}, which is missing"
        files += _files_named(path) if path.is_dir() else [path]
    for entry in kustomization.get("components", []):
        path = (folder / entry).resolve()
        assert path.exists(), f"{folder}/kustomization.yaml names {entry}, which is missing"
        files += _files_named(path)
    for patch in kustomization.get("patches", []):
        if "path" in patch:
            assert (folder / patch["path"]).exists(), f"patch {patch['path']} is missing"
    return files


def _objects(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects: rendered by kustomize when it is installed, else every file
    its kustomization names, as written (patches not applied)."""
    folder = K8S / "overlays" / overlay
    command = _kustomize()
    if command is not None:
        out = subprocess.run([*command, str(folder)], capture_output=True, text=True,
                             check=False, timeout=60)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    return [d for f in _files_named(folder) for d in yaml.safe_load_all(f.read_text()) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, _objects(request.param)


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def test_every_kustomization_names_files_that_exist() -> None:
    for overlay in OVERLAYS:
        files = _files_named(K8S / "overlays" / overlay)
        assert {f.name for f in files} >= {"workers.yaml", "router.yaml", "epp.yaml",
                                           "inferencepool.yaml", "gateway.yaml"}


def _validate(objects: list[dict[str, Any]]) -> set[str]:
    kinds = set()
    for obj in objects:
        kinds.add(obj["kind"])
        schema_file = SCHEMAS.get(obj["apiVersion"])
        if schema_file is None:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        else:
            schema = json.loads((K8S / "schemas" / schema_file).read_text())
            jsonschema.Draft202012Validator(schema).validate(obj)
    return kinds


def test_every_file_named_is_valid_as_written() -> None:
    # What CI checks where no kustomize is installed: the files themselves.
    for overlay in OVERLAYS:
        files = _files_named(K8S / "overlays" / overlay)
        _validate([d for f in files for d in yaml.safe_load_all(f.read_text()) if d])


def test_every_object_is_valid_against_its_schema(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    kinds = _validate(objects)
    assert kinds >= {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget",
                     "InferencePool", "Gateway", "HTTPRoute", "PodMonitor"}


def test_the_inference_pool_schema_refuses_what_the_api_refuses() -> None:
    schema = json.loads((K8S / "schemas" / SCHEMAS["inference.networking.k8s.io/v1"])
                        .read_text())
    validator = jsonschema.Draft202012Validator(schema)
    good = yaml.safe_load((K8S / "base" / "inferencepool.yaml").read_text())
    assert validator.is_valid(good)
    bad_specs = [
        {**good["spec"], "targetPorts": []},
        {**good["spec"], "targetPorts": [{"number": 8000}, {"number": 8001}]},
        {**good["spec"], "endpointPickerRef": {"name": "epp"}},  # a Service needs a port
        {**good["spec"], "endpointPickerRef": {**good["spec"]["endpointPickerRef"],
                                               "failureMode": "Sometimes"}},
        {k: v for k, v in good["spec"].items() if k != "selector"},
        {**good["spec"], "extensionRef": {"name": "epp"}},  # the pre-v1 field
    ]
    for spec in bad_specs:
        assert not validator.is_valid({**good, "spec": spec}), spec


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]  # type: ignore[no-any-return]


def test_workloads_are_probed_bounded_and_locked_down(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert {o["metadata"]["name"] for o in workloads} == {"kvroute-worker", "kvroute-router",
                                                          "kvroute-epp"}
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001  # the image's user
        for c in _containers(w):
            assert c["readinessProbe"] and c["livenessProbe"], w["metadata"]["name"]
            assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert any(b["spec"]["selector"]["matchLabels"].items() <= labels.items()
                   for b in budgets), f"no PodDisruptionBudget for {w['metadata']['name']}"
    assert _one(objects, "Deployment", "kvroute-router")["spec"]["replicas"] == 2


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_settings_are_ones_the_code_reads_and_tokens_come_from_a_secret(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    namespace = "kvroute"
    for name in ("kvroute-router", "kvroute-epp"):
        env = _env(_containers(_one(objects, "Deployment", name))[0])
        plain = {k: re.sub(r"\$\(POD_NAMESPACE\)", namespace, v) for k, v in env.items()
                 if isinstance(v, str) and k.startswith("KVROUTE_")}
        settings = load_settings({}, env=plain)  # refuses malformed values
        assert settings.discover == (
            f"k8s://{namespace}/kubernetes.io/service-name=kvroute-workers?port=http",)
        assert env["KVROUTE_WORKER_ADMIN_TOKEN"]["secretKeyRef"]["name"] == "kvroute-admin"
    router_env = _env(_containers(_one(objects, "Deployment", "kvroute-router"))[0])
    assert router_env["KVROUTE_ADMIN_TOKEN"]["secretKeyRef"] == {"name": "kvroute-admin",
                                                                 "key": "admin-token"}
    worker = _containers(_one(objects, "StatefulSet", "kvroute-worker"))[0]
    env = _env(worker)
    plain = {k: v for k, v in env.items() if isinstance(v, str) and k.startswith("KVROUTE_")}
    unknown = set(plain) - {f"KVROUTE_WORKER_{f.upper()}"
                            for f in load_worker_settings({}, env={}).__dataclass_fields__}
    assert not unknown, f"settings no worker reads: {unknown}"
    assert env["KVROUTE_WORKER_ENGINE"] == ("torch" if overlay == "torch" else "sim")
    gpus = worker["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == ("1" if overlay == "torch" else None)


def test_discovery_may_read_endpointslices_in_its_namespace_and_nothing_more(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    workers = _one(objects, "Service", "kvroute-workers")
    assert any(p["name"] == "http" for p in workers["spec"]["ports"])  # the ?port= it names
    binding = _one(objects, "RoleBinding", "kvroute-discovery")
    role = _one(objects, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    account = _one(objects, "ServiceAccount", "kvroute-discovery")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvroute-discovery",
                                    "namespace": "kvroute"}]
    for name in ("kvroute-router", "kvroute-epp"):
        pod = _one(objects, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == account["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is True  # the token discovery reads
    worker = _one(objects, "StatefulSet", "kvroute-worker")["spec"]["template"]["spec"]
    assert worker["automountServiceAccountToken"] is False


def test_the_gateway_route_pool_and_picker_point_at_each_other(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    pool = _one(objects, "InferencePool", "kvroute")
    workers = _one(objects, "StatefulSet", "kvroute-worker")
    assert pool["spec"]["selector"]["matchLabels"].items() <= \
        workers["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["containerPort"] for p in _containers(workers)[0]["ports"]}
    assert pool["spec"]["targetPorts"][0]["number"] in ports
    picker = pool["spec"]["endpointPickerRef"]
    service = _one(objects, "Service", picker["name"])
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    epp = _one(objects, "Deployment", "kvroute-epp")
    assert service["spec"]["selector"].items() <= \
        epp["spec"]["template"]["metadata"]["labels"].items()
    args = _containers(epp)[0]["args"]
    assert args[:1] == ["epp"] and args[args.index("--grpc-port") + 1] == "9002"
    headless = _one(objects, "Service", "kvroute-workers")
    assert headless["spec"]["clusterIP"] == "None"
    assert workers["spec"]["serviceName"] == "kvroute-workers"
    route = _one(objects, "HTTPRoute", "kvroute")
    gateway = route["spec"]["parentRefs"][0]["name"]
    _one(objects, "Gateway", gateway)
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", "kvroute")


def test_the_pod_monitor_scrapes_every_kvroute_pod_on_a_port_it_has(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    monitor = _one(objects, "PodMonitor", "kvroute")
    assert monitor["metadata"]["namespace"] == "kvroute"
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    endpoints = {e["port"]: e["path"] for e in monitor["spec"]["podMetricsEndpoints"]}
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    for w in workloads:
        name = w["spec"]["template"]["metadata"]["labels"][expression["key"]]
        assert name in expression["values"], name
        ports = {p["name"] for c in _containers(w) for p in c["ports"]}
        assert ports & endpoints.keys(), f"{name} serves metrics on none of {endpoints}"
    assert set(endpoints.values()) == {"/metrics"}
