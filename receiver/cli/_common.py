"""What every command shares: loading the config, logging, running a coroutine."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from nopoll.envelope import DEFAULT_TENANT
from receiver.config.settings import ProviderConfig, Settings, load_settings
from receiver.redis.connector import RedisConnector

__all__ = [
    "add_config_option",
    "add_tenant_option",
    "config_path",
    "deployment_redis",
    "load",
    "provider_for",
    "reach",
    "run_async",
    "run_on_deployment",
    "setup_logging",
]


def add_config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="YAML config file (default: $NOPOLL_CONFIG, else built-in defaults)"
    )


def add_tenant_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tenant",
        default=DEFAULT_TENANT,
        help="the tenant whose account is used (from tenants:, default: the provider's own)",
    )


def provider_for(settings: Settings, provider: str, tenant: str) -> ProviderConfig:
    """``provider``'s config as ``tenant`` uses it; a ConfigError (exit status 2) names
    an unknown provider or tenant, or a tenant without an account there."""
    from nopoll.exceptions import ConfigError
    from receiver.config.accounts import tenant_problem, tenant_provider

    if provider not in settings.providers:
        known = ", ".join(sorted(settings.providers)) or "none"
        raise ConfigError(f"unknown provider {provider!r} (configured: {known})")
    config = tenant_provider(settings, tenant, provider)
    if config is None:
        raise ConfigError(
            tenant_problem(settings, tenant, provider) or f"unknown tenant {tenant!r}"
        )
    return config


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


def deployment_redis(args: argparse.Namespace, settings: Settings) -> tuple[RedisConnector, str]:
    """(connector, where as it may be shown) of the Redis of the running nopoll that a command
    which only talks to a deployment (``submit``, ``watch``) hands its work to.

    With the embedded Redis that is the server a running nopoll started under
    ``data_dir``; when none answers there, a NopollError says so and how to start one:
    a fresh server there would be read by no worker."""
    from nopoll.exceptions import NopollError

    if not settings.embedded_redis:
        connector = RedisConnector(settings.redis)
        return connector, connector.masked_url
    from receiver.embedded import EmbeddedRedis

    server = EmbeddedRedis(settings.data_dir)
    if not server.running():
        source = config_path(args)
        start = f"nopoll serve --config {source}" if source else "nopoll serve"
        raise NopollError(
            f"no nopoll is running on the embedded Redis under data_dir {settings.data_dir}: "
            f"start it first ({start}), or set redis_url to the Redis your nopoll uses"
        )
    return RedisConnector(settings.redis, url=server.url), f"the embedded Redis at {server.url}"


def run_on_deployment(
    args: argparse.Namespace,
    settings: Settings,
    work: Callable[[argparse.Namespace, Settings, RedisConnector, str], Coroutine[Any, Any, int]],
) -> int:
    """The exit status of the command ``work(args, settings, redis, where)`` run on the running
    nopoll's Redis (see :func:`deployment_redis`); a connection to it lost midway is a
    NopollError naming it."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from nopoll.exceptions import NopollError

    redis, where = deployment_redis(args, settings)

    async def run() -> int:
        try:
            return await work(args, settings, redis, where)
        finally:  # every pool the command made is closed on this loop, before it ends
            await redis.aclose()

    try:
        return run_async(run())
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise NopollError(f"lost {where}: {unreachable(exc)}") from None


async def reach(redis: Any, where: str) -> None:
    """A NopollError naming ``where`` unless that Redis answers."""
    from redis.exceptions import RedisError

    from nopoll.exceptions import NopollError

    try:
        await redis.ping()
    except (RedisError, OSError) as exc:
        raise NopollError(f"cannot reach {where}: {unreachable(exc)}") from None


def unreachable(exc: BaseException) -> str:
    """Why a Redis could not be reached, in one line without its address's secrets."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
    if "refused" in str(exc).lower():
        reason = "connection refused"
    return f"{reason} (is it running?)"


def setup_logging(settings: Settings, level: str | None = None) -> None:
    from receiver.logs import configure_logging

    configure_logging(level or settings.log_level, settings.log_format)


def run_async(coro: Any) -> int:
    try:
        import uvloop

        return int(uvloop.run(coro))
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        return int(asyncio.run(coro))
