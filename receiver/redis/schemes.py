"""How a Redis URL's scheme becomes a connection pool: one row per scheme.

Each row takes the URL and the role's connection options (timeouts, health checks) and
returns the pool the connector hands out. A new way to reach Redis (Sentinel, a cluster)
is a module with its pool function and one row here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from redis.asyncio import ConnectionPool

from receiver.redis.sentinel import sentinel_pool
from receiver.redis.wire import guard_connections

__all__ = ["SCHEMES", "PoolFactory", "pool_factory"]

PoolFactory = Callable[[str, Mapping[str, Any]], ConnectionPool]
"""``(url, options) -> pool``: options are redis-py connection keywords."""


def _url_pool(url: str, options: Mapping[str, Any]) -> ConnectionPool:
    """redis-py's own parse of the URL: host, port, db, user, password, TLS, socket path."""
    return guard_connections(ConnectionPool.from_url(url, **options))


SCHEMES: Mapping[str, PoolFactory] = {
    "redis": _url_pool,  # TCP
    "rediss": _url_pool,  # TCP with TLS
    "unix": _url_pool,  # a Unix socket path (the embedded server)
    "redis+sentinel": sentinel_pool,  # the primary a Sentinel set names
    "rediss+sentinel": sentinel_pool,  # the same, with TLS
}


def pool_factory(url: str) -> PoolFactory:
    """The row of ``url``'s scheme; a ValueError naming the scheme (never the URL, which
    may hold a password) when there is none."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    factory = SCHEMES.get(scheme)
    if factory is None:
        known = ", ".join(f"{name}://" for name in SCHEMES)
        shown = f"{scheme}://" if scheme else "a URL without a scheme"
        raise ValueError(f"{shown} is not a Redis URL nopoll can use ({known})")
    return factory
