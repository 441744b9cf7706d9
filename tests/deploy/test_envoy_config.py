"""The shipped Envoy configuration: accepted by Envoy itself, and wired to the EPP protocol."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from bench.envoy import envoy_binary, render_envoy_config

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary")


@pytest.mark.process
def test_envoy_validates_the_shipped_configuration(tmp_path: Path) -> None:
    config = tmp_path / "envoy.yaml"
    config.write_text(render_envoy_config(18000, 18001, 9002))
    result = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(config),
                             "--disable-hot-restart", "-l", "error"],
                            capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_picker_gets_buffered_bodies_and_routes_by_its_header() -> None:
    config = yaml.safe_load(render_envoy_config(18000, 18001, 9002))
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    ext_proc = manager["typed_config"]["http_filters"][0]["typed_config"]
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    workers = clusters["kvroute_workers"]
    assert workers["type"] == "ORIGINAL_DST"
    assert workers["original_dst_lb_config"] == {
        "use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}
