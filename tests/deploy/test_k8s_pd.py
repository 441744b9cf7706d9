"""The disaggregated overlay (deploy/k8s/overlays/pd), rendered and checked offline: every
object against its schema, and the wiring the llm-d routing sidecar pattern needs: roles on
the Services that discovery reads, one discovery target over both Services, the pool's port on
the decode pods' sidecar, and the sidecar sending on to its own worker."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from router.fleet.discovery import parse_target
from router.fleet.k8s_discovery import ROLE_LABEL, K8sTarget
from router.settings import load_settings
from tests.deploy.test_k8s import (
    K8S,
    _containers,
    _env,
    _files_named,
    _kustomize,
    _objects,
    _one,
    _validate,
)

pytestmark = pytest.mark.process  # starts child processes

OVERLAY = "pd"


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    if _kustomize() is None:
        pytest.skip("kustomize or kubectl is needed to apply the pd overlay's patches")
    return _objects(OVERLAY)


def test_the_files_it_names_are_valid_as_written() -> None:
    files = _files_named(K8S / "overlays" / OVERLAY)
    assert "prefill.yaml" in {f.name for f in files}
    _validate([d for f in files for d in yaml.safe_load_all(f.read_text()) if d])


def test_every_object_is_valid_and_every_workload_locked_down(
        objects: list[dict[str, Any]]) -> None:
    assert _validate(objects) >= {"StatefulSet", "InferencePool", "PodMonitor"}
    workloads = {o["metadata"]["name"]: o for o in objects
                 if o["kind"] in ("Deployment", "StatefulSet")}
    assert set(workloads) == {"kvroute-worker", "kvroute-prefill", "kvroute-router",
                              "kvroute-epp"}
    for w in workloads.values():
        assert w["metadata"]["namespace"] == "kvroute"
        for c in _containers(w):
            assert c["readinessProbe"] and c["livenessProbe"], c["name"]
            assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert ":" in c["image"], f"{c['name']}: image {c['image']!r} has no tag"
    monitor = _one(objects, "PodMonitor", "kvroute")
    assert "kvroute-prefill" in monitor["spec"]["selector"]["matchExpressions"][0]["values"]


def _target(container: dict[str, Any]) -> K8sTarget:
    plain = {k: v.replace("$(POD_NAMESPACE)", "kvroute") for k, v in _env(container).items()
             if isinstance(v, str) and k.startswith("KVROUTE_")}
    (text,) = load_settings({}, env=plain).discover  # refuses a malformed target
    target = parse_target(text)
    assert isinstance(target, K8sTarget) and target.namespace == "kvroute"
    return target


def _slice_port(service: dict[str, Any], name: str, pod: dict[str, Any]) -> int:
    """The port number an EndpointSlice of ``service`` gives under ``name``: its target port,
    resolved against the pod's containers when it is a name."""
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == name]
    target = port.get("targetPort", port["port"])
    if isinstance(target, int):
        return target
    numbers = {p["name"]: p["containerPort"] for c in _containers(pod) for p in c["ports"]}
    return numbers[target]


def test_roles_are_labels_on_the_services_discovery_watches(
        objects: list[dict[str, Any]]) -> None:
    services = {"decode": _one(objects, "Service", "kvroute-workers"),
                "prefill": _one(objects, "Service", "kvroute-prefill")}
    for role, service in services.items():
        assert service["metadata"]["labels"][ROLE_LABEL] == role
        assert service["spec"]["clusterIP"] == "None"
    for name in ("kvroute-router", "kvroute-epp"):
        target = _target(_containers(_one(objects, "Deployment", name))[0])
        match = re.fullmatch(r"kubernetes\.io/service-name in \((.*)\)", target.selector)
        assert match, target.selector
        assert set(match.group(1).split(",")) == {"kvroute-workers", "kvroute-prefill"}
        for service in services.values():  # each names the port the target asks for
            assert target.port in {p["name"] for p in service["spec"]["ports"]}


def test_the_picker_names_sidecars_as_destinations_and_prefill_workers_directly(
        objects: list[dict[str, Any]]) -> None:
    decode = _one(objects, "StatefulSet", "kvroute-worker")
    prefill = _one(objects, "StatefulSet", "kvroute-prefill")
    containers = {c["name"]: c for c in _containers(decode)}
    sidecar, worker = containers["routing-sidecar"], containers["worker"]
    args = dict(a.lstrip("-").split("=", 1) for a in sidecar["args"])
    worker_port = int(_env(worker)["KVROUTE_WORKER_PORT"])
    assert int(args["vllm-port"]) == worker_port  # the sidecar sends on to its own worker
    assert args["connector"] == "nixlv2"  # the kv_transfer_params two-step
    epp_port = _target(_containers(_one(objects, "Deployment", "kvroute-epp"))[0]).port
    assert epp_port is not None
    # On decode pods the picker's port is the sidecar's, which is the pool's target port (an
    # endpoint Envoy knows); on prefill pods it is the worker's, where the prefill goes.
    sidecar_port = _slice_port(_one(objects, "Service", "kvroute-workers"), epp_port, decode)
    assert sidecar_port == int(args["port"])
    pool = _one(objects, "InferencePool", "kvroute")
    assert pool["spec"]["targetPorts"] == [{"number": sidecar_port}]
    assert pool["spec"]["selector"]["matchLabels"].items() <= \
        decode["spec"]["template"]["metadata"]["labels"].items()
    assert not pool["spec"]["selector"]["matchLabels"].items() <= \
        prefill["spec"]["template"]["metadata"]["labels"].items()  # Envoy never sends there
    prefill_worker = _containers(prefill)[0]
    assert _slice_port(_one(objects, "Service", "kvroute-prefill"), epp_port, prefill) == \
        int(_env(prefill_worker)["KVROUTE_WORKER_PORT"])
    # The router goes straight to the workers on both pools (it runs the prefill step itself).
    router_port = _target(_containers(_one(objects, "Deployment", "kvroute-router"))[0]).port
    assert router_port is not None
    assert _slice_port(_one(objects, "Service", "kvroute-workers"), router_port, decode) == \
        worker_port
