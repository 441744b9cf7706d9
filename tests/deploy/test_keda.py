"""The KEDA autoscaling component, checked offline: the ScaledObject against a schema written
from KEDA's documented fields (kubernetes-validate has no KEDA schema), its HPA behaviour
against Kubernetes' own, and its wiring: the workers it scales, the metric it reads."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.exported import exported, router_exposition

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
COMPONENT = K8S / "components" / "autoscaling"
SCHEMA = json.loads((K8S / "schemas" / "keda-scaledobject-v1alpha1.schema.json").read_text())


def scaled_object() -> dict[str, Any]:
    kustomization = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Component"
    (resource,) = kustomization["resources"]
    (obj,) = [d for d in yaml.safe_load_all((COMPONENT / resource).read_text()) if d]
    return obj


def test_the_scaled_object_is_valid_against_keda_s_documented_fields() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA).validate(scaled_object())


def _set(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    *parents, last = path.split(".")
    node: Any = obj
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return obj


@pytest.mark.parametrize(("path", "value"), [
    ("spec.triggers.0.metadata.treshold", "0.7"),  # a typo
    ("spec.triggers.0.metadata.threshold", 0.7),  # KEDA reads metadata as strings
    ("spec.triggers.0.metadata.query", None),
    ("spec.triggers.0.metricType", "Average"),
    ("spec.triggers.0.metadata.serverAddress", "prometheus:9090"),
    ("spec.scaleTargetRef.name", None),
    ("spec.minReplicas", 1),
    ("spec.triggers", []),
])
def test_the_schema_refuses_what_keda_would(path: str, value: Any) -> None:
    assert not jsonschema.Draft202012Validator(SCHEMA).is_valid(
        _set(scaled_object(), path, value))


def test_its_hpa_behaviour_is_valid_for_kubernetes() -> None:
    behavior = scaled_object()["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "check"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                       "name": "kvroute-worker"},
                    "maxReplicas": 2, "behavior": behavior}}
    kubernetes_validate.validate(hpa, kubernetes_validate.latest_version(), strict=True)


def test_it_scales_the_worker_statefulset_on_a_metric_the_router_exports() -> None:
    obj = scaled_object()
    workers = [d for d in yaml.safe_load_all((K8S / "base" / "workers.yaml").read_text())
               if d and d["kind"] == "StatefulSet"]
    namespace = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["namespace"]
    target = obj["spec"]["scaleTargetRef"]
    assert [(w["apiVersion"], w["kind"], w["metadata"]["name"]) for w in workers] == [
        (target["apiVersion"], target["kind"], target["name"])]
    assert obj["metadata"]["namespace"] == namespace
    (trigger,) = obj["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    query = trigger["metadata"]["query"]
    names = set(re.findall(r"kvroute_[a-z_]+", query))
    assert names == {"kvroute_prefill_demand_ratio"}
    assert names <= exported(router_exposition())
    assert f'namespace="{namespace}"' in query
    spec = obj["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["fallback"]["replicas"] <= spec["maxReplicaCount"]
