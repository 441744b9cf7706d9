"""``kvroute worker`` and ``kvroute router``: settings read once, then uvicorn until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

_OWN = ("command", "config", "events_command")


def serve(args: argparse.Namespace) -> int:
    """Build the app for ``args.command`` from flags and environment, and serve it."""
    flags = {k: v for k, v in vars(args).items() if k not in _OWN}
    try:
        if args.command == "worker":
            from workers.http.api import create_app as create_worker
            from workers.settings import load_worker_settings

            worker = load_worker_settings(flags)
            app, host, port, level = create_worker(worker), worker.host, worker.port, \
                worker.log_level
        else:
            from router.app import create_app as create_router
            from router.settings import load_settings

            router = load_settings(flags, config_file=args.config)
            app, host, port, level = create_router(router), router.host, router.port, \
                router.log_level
    except ValueError as exc:
        print(f"kvroute {args.command}: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    # One line per health poll would drown everything else: control-call logs only on trouble.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    uvicorn.run(app, host=host, port=port, log_level=level, access_log=False,
                timeout_graceful_shutdown=5)
    return 0
