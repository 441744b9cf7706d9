"""``kvroute worker`` and ``kvroute router``: settings read once, then uvicorn until SIGTERM."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from httpapi.logs import configure_logging
from httpapi.server import raise_open_file_limit, server_config

_OWN = ("command", "config", "events_command")


def serve(args: argparse.Namespace) -> int:
    """Build the app for ``args.command`` from flags and environment, and serve it."""
    flags = {k: v for k, v in vars(args).items() if k not in _OWN}
    try:
        if args.command == "worker":
            from workers.http.api import create_app as create_worker
            from workers.settings import load_worker_settings

            settings = load_worker_settings(flags)
            app = create_worker(settings)
        else:
            from router.http.app import create_app as create_router
            from router.settings import load_settings

            settings = load_settings(flags, config_file=args.config)
            app = create_router(settings)
    except ValueError as exc:
        print(f"kvroute {args.command}: {exc}", file=sys.stderr)
        return 2
    level = settings.log_level
    try:
        configure_logging(level, settings.log_format)
    except ValueError as exc:
        print(f"kvroute {args.command}: {exc}", file=sys.stderr)
        return 2
    limits = settings.connection_limits()
    raise_open_file_limit(limits)
    uvicorn.Server(server_config(app, settings.host, settings.port, limits, level,
                                 log_config=None)).run()
    return 0
