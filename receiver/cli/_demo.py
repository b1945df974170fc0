"""``nopoll demo``: nopoll end to end against the built-in provider simulator."""

from __future__ import annotations

import argparse
from typing import Any


def _cmd_demo(args: argparse.Namespace) -> int:
    from receiver.demo.run import run_demo

    return run_demo(n=args.n, data_dir=args.data_dir, keep=args.keep)


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    p = sub.add_parser("demo", help="run nopoll end to end against a built-in provider simulator")
    p.add_argument(
        "--n", type=int, default=200, help="background responses to complete (default 200)"
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="the demo folder, kept afterwards (default: a temporary folder, removed at the end)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the demo folder: its nopoll.yaml (with the demo's webhook secret, mode 0600) "
        "works with every command",
    )
    p.set_defaults(func=_cmd_demo)
