"""The compose deployment, run for real: the project's image built with podman, the project's
``docker-compose.yml`` brought up with podman-compose, requests through the official OpenAI
client, a repeat hitting its prefix holder, a killed worker container failed over and its
prefix learned again elsewhere, and ``down`` leaving no container behind.

Skips, saying which check failed, only where no container can run (see
:func:`e2e.containers.unusable`); ``make test`` installs podman, runc and debootstrap from
Debian's packages when it runs as root.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from e2e.containers import HOME, REPO, Runtime, unusable
from kvroute.up import free_port
from tests.support.eventually import eventually_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

# Long enough to fill several 32-token blocks with the byte tokenizer.
PROMPT = "You are a careful assistant for the kvroute compose test. " * 12


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    why = unusable(HOME)
    if why is not None:
        pytest.skip(f"no container runtime: {why}")
    runtime = Runtime(HOME)
    runtime.build_project()
    return runtime


@pytest.fixture
def deployment(runtime: Runtime) -> Iterator[tuple[str, dict[str, str]]]:
    project = f"kvroute-e2e-{os.getpid()}"
    env = {"KVROUTE_ADMIN_TOKEN": secrets.token_hex(16),
           "KVROUTE_PUBLISH_PORT": str(free_port())}
    compose_file = REPO / "docker-compose.yml"
    try:
        runtime.compose(project, compose_file, "up", "-d", "--no-build", env=env)
        yield project, env
    finally:
        # Printed, so a failure's report holds the router's side of it (``down`` removes it).
        logs = runtime.podman("logs", "--tail", "200", f"{project}_router_1", check=False)
        print(f"router container log (last 200 lines):\n{logs.stdout}{logs.stderr}")
        runtime.compose(project, compose_file, "down", env=env)


def _completion(client: openai.OpenAI, prompt: str) -> tuple[str, int, str]:
    raw = client.completions.with_raw_response.create(model="kvroute-sim", prompt=prompt,
                                                      max_tokens=4)
    answer = raw.parse()
    return (raw.headers["x-kvroute-worker"], int(raw.headers["x-kvroute-matched-blocks"]),
            answer.choices[0].text)


def test_compose_serves_routes_fails_over_and_comes_down(
        runtime: Runtime, deployment: tuple[str, dict[str, str]]) -> None:
    project, env = deployment
    base = f"http://127.0.0.1:{env['KVROUTE_PUBLISH_PORT']}"
    assert len(runtime.containers(project)) == 4
    eventually_blocking(lambda: httpx.get(f"{base}/ready", timeout=5).json().get("workers") == 3,
                        "the router in its container to see three healthy workers", 240,
                        tolerate=(httpx.HTTPError, ValueError))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

    holder, matched, text = _completion(client, PROMPT)
    assert matched == 0 and text
    # The holder's events reach the router over the compose network; then a repeat hits it.
    def repeat_hits() -> bool:
        worker, blocks, _ = _completion(client, PROMPT)
        return worker == holder and blocks > 0
    eventually_blocking(repeat_hits, "a repeat to hit its prefix holder", 60)

    # Kill the holder's container: the next requests still succeed (failover), and the prefix
    # is learned again on whichever worker serves it now.
    service = httpx.URL(holder).host
    runtime.podman("kill", f"{project}_{service}_1")
    for _ in range(5):
        _, _, text = _completion(client, PROMPT + " and again")
        assert text
    def relearned() -> bool:
        first, _, _ = _completion(client, PROMPT + " once more")
        again, blocks, _ = _completion(client, PROMPT + " once more")
        return again == first and blocks > 0
    eventually_blocking(relearned, "the prompt to be learned again after the holder died", 120)

    runtime.compose(project, REPO / "docker-compose.yml", "down", env=env)
    assert runtime.containers(project) == []


def test_the_runtime_check_names_what_is_missing(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "podman is not installed" in (unusable(tmp_path) or "")
