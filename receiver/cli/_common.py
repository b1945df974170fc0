"""What every command shares: loading the config, logging, running a coroutine."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from receiver.config import Settings, load_settings

__all__ = ["add_config_option", "load", "run_async", "setup_logging"]


def add_config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="YAML config file (default: $NOPOLL_CONFIG, else built-in defaults)"
    )


def load(args: argparse.Namespace) -> Settings:
    path = args.config or os.environ.get("NOPOLL_CONFIG") or None
    return load_settings(path)


def setup_logging(settings: Settings, level: str | None = None) -> None:
    from receiver.logs import configure_logging

    configure_logging(level or settings.log_level, settings.log_format)


def run_async(coro: Any) -> int:
    try:
        import uvloop

        return int(uvloop.run(coro))
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        return int(asyncio.run(coro))
