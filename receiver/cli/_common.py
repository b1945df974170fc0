"""What every command shares: loading the config, logging, running a coroutine."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from receiver.config import Settings, load_settings

__all__ = ["add_config_option", "config_path", "load", "run_async", "setup_logging"]


def add_config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="YAML config file (default: $NOPOLL_CONFIG, else built-in defaults)"
    )


def config_path(args: argparse.Namespace) -> str | None:
    """The config file named by ``--config`` or ``NOPOLL_CONFIG``; ``None``: no config."""
    return args.config or os.environ.get("NOPOLL_CONFIG") or None


def load(args: argparse.Namespace, *, require_env: bool = True) -> Settings:
    """The settings of the config file; ``require_env=False`` for read-only commands, which
    print what is still unset as notes (on stderr) instead of refusing."""
    settings = load_settings(config_path(args), require_env=require_env)
    for note in settings.notes:
        print(f"nopoll: note: {note}", file=sys.stderr)
    return settings


def setup_logging(settings: Settings, level: str | None = None) -> None:
    from receiver.logs import configure_logging

    configure_logging(level or settings.log_level, settings.log_format)


def run_async(coro: Any) -> int:
    try:
        import uvloop

        return int(uvloop.run(coro))
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        return int(asyncio.run(coro))
