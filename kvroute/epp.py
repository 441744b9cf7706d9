"""``kvroute epp``: the router's settings read once, then the endpoint picker until SIGTERM."""

from __future__ import annotations

import argparse
import os
import sys

_OWN = ("command", "config", "events_command", "grpc_port", "metrics_port")
DEFAULT_GRPC_PORT = 9002


def serve_epp(args: argparse.Namespace) -> int:
    """Build the router settings from flags, environment and config file; serve ext_proc."""
    from router.epp.server import run_epp
    from router.settings import load_settings

    flags = {k: v for k, v in vars(args).items() if k not in _OWN}
    try:
        settings = load_settings(flags, config_file=args.config)
        port = args.grpc_port
        if port is None:
            raw = os.environ.get("KVROUTE_EPP_GRPC_PORT", str(DEFAULT_GRPC_PORT))
            try:
                port = int(raw)
            except ValueError:
                raise ValueError(f"KVROUTE_EPP_GRPC_PORT={raw!r} is not a port") from None
        if not 0 < port < 65536:
            raise ValueError(f"--grpc-port {port} is not in 1..65535")
        metrics_port = args.metrics_port
        if metrics_port is not None and not 0 < metrics_port < 65536:
            raise ValueError(f"--metrics-port {metrics_port} is not in 1..65535")
    except ValueError as exc:
        print(f"kvroute epp: {exc}", file=sys.stderr)
        return 2
    from httpapi.logs import configure_logging

    try:
        configure_logging(settings.log_level, settings.log_format)
    except ValueError as exc:
        print(f"kvroute epp: {exc}", file=sys.stderr)
        return 2
    return run_epp(settings, port, metrics_port)
