"""Envoy and kvroute's endpoint picker as processes, for end-to-end tests.

:class:`Epp` is ``kvroute epp`` in front of given workers; :class:`Envoy` runs Envoy with
``deploy/envoy/envoy.yaml`` (the shipped configuration, :mod:`bench.envoy`) filled in with
free ports on 127.0.0.1. Waits are bounded and poll a condition.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.envoy import envoy_command, render_envoy_config
from e2e.harness import NOT_YET, Process, Worker
from kvroute.up import free_port
from tests.support.eventually import eventually_blocking


class Epp(Process):
    """``kvroute epp`` in front of ``workers``."""

    def __init__(self, name: str, workers: list[Worker], log_dir: Path, **settings: Any
                 ) -> None:
        self.grpc_port = free_port()
        self.metrics_port = free_port()
        env = {"KVROUTE_WORKERS": ",".join(w.url for w in workers),
               "KVROUTE_HEALTH_INTERVAL": "0.2", "KVROUTE_UNHEALTHY_GRACE": "1.0"}
        env |= {f"KVROUTE_{k.upper()}": str(v) for k, v in settings.items()}
        super().__init__(name, ["epp", "--grpc-port", str(self.grpc_port),
                                "--metrics-port", str(self.metrics_port)], env, log_dir)

    def healthy_workers(self) -> int:
        """How many workers the picker counts healthy (its ``kvroute_workers`` metric)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith('kvroute_workers{state="healthy"}'):
                return int(float(line.split()[-1]))
        raise AssertionError(f"{self.name} reports no healthy-worker count:\n{text[:2000]}")

    def health(self, service: str = "readiness") -> int:
        """The gRPC health status of ``service`` (1 serving, 2 not serving)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service),  # type: ignore[no-any-return]
                              timeout=2).status

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"{self.name} exited:\n{self.tail()}")
            try:
                return self.health() == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False
        eventually_blocking(ready, f"{self.name} serving", timeout, tolerate=NOT_YET)


class Envoy(Process):
    """Envoy with the shipped configuration, sending every request's choice to ``epp``
    (``full_duplex``: with ``request_body_mode: FULL_DUPLEX_STREAMED`` instead)."""

    def __init__(self, name: str, epp: Epp, log_dir: Path, full_duplex: bool = False) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        self.config = log_dir / f"{name}.yaml"
        config = render_envoy_config(self.port, self.admin_port, epp.grpc_port)
        if full_duplex:  # the body streamed to the EPP chunk by chunk (GIE's streaming mode)
            config = config.replace("request_body_mode: BUFFERED",
                                    "request_body_mode: FULL_DUPLEX_STREAMED").replace(
                                    "request_trailer_mode: SKIP", "request_trailer_mode: SEND")
            assert "FULL_DUPLEX_STREAMED" in config
        self.config.write_text(config)
        super().__init__(name, [], {}, log_dir)
        self.client = httpx.Client(base_url=self.url, timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        out = self.log.open("ab")
        self.popen = subprocess.Popen(envoy_command(self.config), env=dict(os.environ),
                                      stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        out.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"{self.name} exited:\n{self.tail()}")
            return httpx.get(f"http://127.0.0.1:{self.admin_port}/ready").status_code == 200
        eventually_blocking(ready, f"{self.name} ready", timeout, tolerate=NOT_YET)

    def kill(self, sig: int = 9) -> None:
        super().kill(sig)
        self.client.close()

    def complete(self, prompt: str, max_tokens: int = 4, **extra: Any) -> httpx.Response:
        body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": max_tokens, **extra}
        return self.client.post("/v1/completions", json=body)
