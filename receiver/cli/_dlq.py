"""``nopoll dlq list|replay``: dead letters.

Both say which Redis they read. ``list`` is read-only: it needs no provider secret in the
environment, and it never starts an embedded Redis where none ever ran (nor creates a
``data_dir`` for one); with no config and nothing under ``./nopoll-data`` it refuses and
says how to point it at the Redis that holds the dead letters.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from nopoll.exceptions import ConfigError, NopollError
from receiver.cli._common import add_config_option, config_path, load
from receiver.config.settings import Settings
from receiver.redis.connector import RedisConnector


async def _dlq(
    args: argparse.Namespace, redis: RedisConnector, where: str, sinks: list[str]
) -> int:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from receiver.queue._arq import arq_pool
    from receiver.queue.deadletter import DeadLetters

    pool = arq_pool(redis)
    try:
        letters = DeadLetters(pool)
        found = await letters.find(sink=args.sink, key=getattr(args, "key", None))
        if not found and args.sink is not None and args.sink not in sinks:
            # a sink removed from the config may still have letters: those are shown
            raise ConfigError(
                f"no such sink {args.sink!r}: dead letters belong to one of "
                f"{', '.join(sinks)} ('fetch': failed fetches, 'watch': expired watches)"
            )
        if args.dlq_command == "list":
            if not found:
                print(f"no dead letters in {where}")
                return 0
            print(f"{'id':32}  {'sink':12} {'provider':12} {'tries':>5}  keys / last error")
            for d in found:
                keys = ", ".join(d.keys[:3]) + (
                    f" (+{len(d.keys) - 3} more)" if len(d.keys) > 3 else ""
                )
                print(f"{d.id:32}  {d.sink:12} {d.provider:12} {d.attempts:>5}  {keys}")
                print(f"{'':32}  {d.error}")
            print(f"{len(found)} dead letter(s) in {where}")
            return 0
        count = await letters.replay(found)
        print(f"{count} dead letter(s) queued again in {where}; a running worker delivers them")
        return 0
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise NopollError(f"cannot reach {where}: {type(exc).__name__}") from None
    finally:
        await pool.aclose()


def _where(args: argparse.Namespace, settings: Settings) -> str:
    """Which Redis the dead letters are in, as it may be shown; refuses (ConfigError)
    when there is none to read."""
    command = f"dlq {args.dlq_command}"
    unset = settings.unset_env.get("redis.url")
    if unset:
        raise ConfigError(
            f"redis_url: {', '.join(unset)} is not set, and {command} needs it to find the "
            "Redis that holds the dead letters"
        )
    if not settings.embedded_redis:
        return RedisConnector(settings.redis).masked_url
    from receiver.embedded import EmbeddedRedis

    server = EmbeddedRedis(settings.data_dir)
    if server.dir.is_dir():  # running, or its data kept: started only for this command
        return f"the embedded Redis at {server.url}"
    data_dir = settings.data_dir.resolve()
    source = config_path(args)
    if source is None:
        raise ConfigError(
            f"no config (--config or NOPOLL_CONFIG), and no embedded Redis ever ran under "
            f"{data_dir}: {command} would read {server.url}, which does not exist. Point it "
            "at the Redis your nopoll uses: --config FILE, or NOPOLL_CONFIG=FILE (with its "
            "redis_url, or the data_dir of the nopoll that ran with the built-in defaults)"
        )
    raise ConfigError(
        f"{source} has no redis_url, and no embedded Redis ever ran under its data_dir "
        f"{data_dir}: is data_dir right? A relative data_dir is relative to the config "
        "file's folder"
    )


def _cmd_dlq(args: argparse.Namespace) -> int:
    from receiver.runtime import redis_for

    settings = load(args, require_env=args.dlq_command != "list")
    where = _where(args, settings)
    with redis_for(settings) as redis:
        return asyncio.run(_dlq(args, redis, where, [*settings.sinks, "fetch", "watch"]))


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    dlq = sub.add_parser("dlq", help="list or replay dead letters")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    p = dlq_sub.add_parser("list", help="show dead letters (needs no secret in the environment)")
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
