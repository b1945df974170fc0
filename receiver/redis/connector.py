"""The one way nopoll connects to Redis: a :class:`RedisConnector` built once from the
``redis:`` section and handed to every component, which asks it for a client or a pool
of its role. The URL stays inside; logs and the start-up summary get :attr:`masked_url`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr
from redis.asyncio import ConnectionPool, Redis

from nopoll.exceptions import ConfigError
from nopoll.wire import url_credentials_masked
from receiver.redis.config import RedisConfig, RedisRole
from receiver.redis.schemes import PoolFactory, pool_factory

if TYPE_CHECKING:
    from arq.connections import RedisSettings

__all__ = ["RedisConnector"]

_HEALTH_CHECK_S = {"api": 30}
"""Roles whose idle connections are PINGed before use after this many seconds."""


class RedisConnector:
    """Clients and pools of one Redis, each with its role's timeouts (``redis:`` section).

    ``url`` overrides ``config.url`` (the embedded server's, found at start-up). The
    URL's scheme picks how pools are made (:data:`~receiver.redis.schemes.SCHEMES`); one
    it has no row for is a ConfigError. Every pool it makes is closed by :meth:`aclose`,
    whoever else closed it already.
    """

    def __init__(self, config: RedisConfig, *, url: str | None = None) -> None:
        self.config = config
        self._url = SecretStr(url) if url is not None else config.url
        if not self._url.get_secret_value():
            raise ValueError("a RedisConnector needs a Redis URL")
        self._make_pool = _factory(self._url.get_secret_value())
        self._pools: weakref.WeakSet[ConnectionPool] = weakref.WeakSet()

    @classmethod
    def from_url(cls, url: str) -> RedisConnector:
        """A connector to ``url`` with the default timeouts (tools and tests)."""
        return cls(RedisConfig(), url=url)

    @property
    def masked_url(self) -> str:
        """The URL as it may be shown: its password and every query value masked."""
        return url_credentials_masked(self._url.get_secret_value())

    def __repr__(self) -> str:
        return f"RedisConnector({self.masked_url!r})"

    def pool(self, role: RedisRole, *, at_most_s: float | None = None) -> ConnectionPool:
        """A new connection pool of ``role``; ``at_most_s`` caps both its timeouts."""
        timeouts = self.config.timeouts(role)
        connect_s, socket_s = timeouts.connect_s, timeouts.socket_s
        if at_most_s is not None:
            connect_s, socket_s = min(connect_s, at_most_s), min(socket_s, at_most_s)
        kwargs: dict[str, Any] = {"socket_connect_timeout": connect_s, "socket_timeout": socket_s}
        if role in _HEALTH_CHECK_S:
            kwargs["health_check_interval"] = _HEALTH_CHECK_S[role]
        pool = self._make_pool(self._url.get_secret_value(), kwargs)
        self._pools.add(pool)
        return pool

    def client(self, role: RedisRole, *, at_most_s: float | None = None) -> Redis:
        """A new client of ``role`` on a pool of its own, closed with the client."""
        client = Redis(connection_pool=self.pool(role, at_most_s=at_most_s))
        client.auto_close_connection_pool = True
        return client

    def arq_settings(self) -> RedisSettings:
        """arq's own connection settings for this Redis (the ``queue`` role's connect
        timeout). nopoll's workers take a pool instead (:func:`receiver.queue._arq.arq_pool`);
        this is for arq tooling. Its ``repr`` prints the password: never log it."""
        from arq.connections import RedisSettings  # arq is the worker's: not loaded before

        settings = RedisSettings.from_dsn(self._url.get_secret_value())
        settings.conn_timeout = max(1, round(self.config.queue.connect_s))
        return settings

    async def aclose(self) -> None:
        """Close every pool this connector made (a closed one closes again harmlessly)."""
        for pool in list(self._pools):
            await pool.disconnect()


def _factory(url: str) -> PoolFactory:
    try:
        return pool_factory(url)
    except ValueError as exc:
        raise ConfigError(f"redis.url: {exc}") from None
