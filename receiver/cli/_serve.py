"""``nopoll serve|api|worker``: run the API, the worker, or both."""

from __future__ import annotations

import argparse
from typing import Any

from receiver.cli._common import add_config_option, config_path, load, setup_logging


def _cmd_run(args: argparse.Namespace) -> int:
    from receiver.runtime import run

    settings = load(args)
    setup_logging(settings)
    api = args.command in ("serve", "api")
    worker = args.command in ("serve", "worker")
    health_port = getattr(args, "health_port", None)
    run(
        settings,
        api=api,
        worker=worker,
        health=(args.health_host, health_port) if health_port else None,
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 8000),
        config=config_path(args),
        worker_id=getattr(args, "worker_id", None),
    )
    return 0


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    for name, help_ in (
        ("serve", "run the API and the worker in one process"),
        ("api", "run the API only"),
    ):
        p = sub.add_parser(name, help=help_)
        add_config_option(p)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=8000)
        if name == "serve":
            _add_worker_id(p)
        p.set_defaults(func=_cmd_run)
    p = sub.add_parser("worker", help="run the worker only")
    add_config_option(p)
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve GET /healthz and /metrics of this worker process on this port",
    )
    p.add_argument("--health-host", default="127.0.0.1", help="address for --health-port")
    _add_worker_id(p)
    p.set_defaults(func=_cmd_run)


def _add_worker_id(p: Any) -> None:
    p.add_argument(
        "--worker-id",
        default=None,
        help="this worker process's id (default: the host name and the data_dir); a "
        "worker restarted with the same id takes back at once what it held before",
    )
