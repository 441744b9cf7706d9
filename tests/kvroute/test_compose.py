"""The compose deployment: valid, and configured through the same settings the code reads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.settings import load_settings
from workers.settings import load_worker_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.process
@pytest.mark.skipif(not _docker_compose_available(), reason="no docker compose CLI here")
def test_docker_compose_accepts_the_file() -> None:
    result = subprocess.run(["docker", "compose", "-f", str(REPO / "docker-compose.yml"),
                             "config", "-q"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def _dockerfile_env() -> dict[str, str]:
    text = (REPO / "Dockerfile").read_text()
    block = re.search(r"^ENV (.+?)(?:\n\S|\Z)", text, re.S | re.M)
    assert block, "the Dockerfile sets the bind addresses"
    pairs = re.findall(r"(\w+)=(\S+)", block.group(1))
    return dict(pairs)


def test_a_router_and_three_workers_with_health_checks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    workers = sorted(name for name in services if name.startswith("worker-"))
    assert workers == ["worker-0", "worker-1", "worker-2"]
    for name, service in services.items():
        assert service["restart"] == "unless-stopped", name
        assert "healthcheck" in service, name
    router = services["router"]
    assert set(router["depends_on"]) == set(workers)
    # Published on loopback only; KVROUTE_PUBLISH_PORT (compose interpolation) picks the port.
    assert router["ports"] == ["127.0.0.1:${KVROUTE_PUBLISH_PORT:-8000}:8000"]


def test_every_environment_variable_is_a_setting_the_code_reads(
        compose: dict[str, Any]) -> None:
    image_env = _dockerfile_env()
    services = compose["services"]
    for name in ("worker-0", "worker-1", "worker-2"):
        env = {**image_env, **services[name]["environment"]}
        settings = load_worker_settings({}, env=env)
        assert (settings.host, settings.events_host) == ("0.0.0.0", "0.0.0.0")
        worker_keys = {k for k in env if k.startswith("KVROUTE_WORKER_")}
        assert all(hasattr(settings, k[len("KVROUTE_WORKER_"):].lower()) for k in worker_keys)
    env = {**image_env, **services["router"]["environment"]}
    router = load_settings({}, env=env)
    assert router.host == "0.0.0.0"
    router_keys = {k for k in services["router"]["environment"]}
    assert all(hasattr(router, k[len("KVROUTE_"):].lower()) for k in router_keys)
    # the router reaches each worker by its service name, on the port the worker listens on
    for url, name in zip(router.workers, ("worker-0", "worker-1", "worker-2"), strict=True):
        port = services[name]["environment"]["KVROUTE_WORKER_PORT"]
        assert url == f"http://{name}:{port}"


def test_a_wildcard_event_endpoint_is_reached_at_the_workers_service_name() -> None:
    from router.fleet.worker_answers import parse_model_info

    info = parse_model_info("http://worker-1:8100", json.dumps({
        "model": "m", "block_size": 32, "tokenizer": "bytes-v1", "instance_id": "i",
        "events_endpoint": "tcp://0.0.0.0:5557", "replay_endpoint": "tcp://*:5558"}).encode())
    assert info.events_endpoint == "tcp://worker-1:5557"
    assert info.replay_endpoint == "tcp://worker-1:5558"
