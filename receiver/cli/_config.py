"""``nopoll config check``: validate a config file and say what it configures."""

from __future__ import annotations

import argparse
from typing import Any

from receiver.cli._common import add_config_option, load


def _cmd_config_check(args: argparse.Namespace) -> int:
    settings = load(args)
    print("config OK")
    print(
        "  redis: "
        + (f"embedded (under {settings.data_dir})" if settings.embedded_redis else "external")
    )
    for name, p in settings.providers.items():
        print(
            f"  provider {name}: dialect {p.dialect}, {p.base_url}, "
            f"{len(p.webhook_secrets)} webhook secret(s), tolerance {p.tolerance_s}s"
        )
    for name, s in settings.sinks.items():
        print(f"  sink {name}: {s.type}")
    if settings.routes:
        for i, r in enumerate(settings.routes):
            print(f"  route {i}: {r.match.model_dump(exclude_none=True)} -> {', '.join(r.sinks)}")
    else:
        print("  routes: none (every result goes to every sink)")
    return 0


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    cfg = sub.add_parser("config", help="configuration tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    p = cfg_sub.add_parser("check", help="validate a config file and print what it configures")
    add_config_option(p)
    p.set_defaults(func=_cmd_config_check)
