"""``nopoll dlq list|replay``: dead letters."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from receiver.cli._common import add_config_option, load
from receiver.config import Settings


async def _dlq(args: argparse.Namespace, settings: Settings, url: str) -> int:
    from receiver.deadletter import DeadLetters
    from receiver.queue import arq_pool

    pool = arq_pool(url)
    try:
        letters = DeadLetters(pool)
        found = await letters.find(sink=args.sink, key=getattr(args, "key", None))
        if args.dlq_command == "list":
            if not found:
                print("no dead letters")
                return 0
            print(f"{'id':32}  {'sink':12} {'provider':12} {'tries':>5}  keys / last error")
            for d in found:
                keys = ", ".join(d.keys[:3]) + (
                    f" (+{len(d.keys) - 3} more)" if len(d.keys) > 3 else ""
                )
                print(f"{d.id:32}  {d.sink:12} {d.provider:12} {d.attempts:>5}  {keys}")
                print(f"{'':32}  {d.error}")
            print(f"{len(found)} dead letter(s)")
            return 0
        count = await letters.replay(found)
        print(f"{count} dead letter(s) queued again; a running worker delivers them")
        return 0
    finally:
        await pool.aclose()


def _cmd_dlq(args: argparse.Namespace) -> int:
    from receiver.runtime import redis_url_for

    settings = load(args)
    with redis_url_for(settings) as url:
        return asyncio.run(_dlq(args, settings, url))


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    dlq = sub.add_parser("dlq", help="list or replay dead letters")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    p = dlq_sub.add_parser("list", help="show dead letters")
    add_config_option(p)
    p.add_argument("--sink", help="only this sink's ('fetch' for failed fetches)")
    p.set_defaults(func=_cmd_dlq)
    p = dlq_sub.add_parser(
        "replay", help="queue dead letters again (all of them without a selector)"
    )
    add_config_option(p)
    p.add_argument("--sink", help="only this sink's ('fetch' for failed fetches)")
    p.add_argument("--key", help="only dead letters that hold this result key")
    p.set_defaults(func=_cmd_dlq)
