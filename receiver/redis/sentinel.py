"""Redis behind Sentinel: ``redis+sentinel://`` (and ``rediss+sentinel://``, TLS) URLs.

``redis+sentinel://[[user]:password@]host1[:port1][,host2[:port2]...]/service[/db]``
names the Sentinel set (port 26379 when left out), the monitored service and the
database; the user and password are the Redis servers'. Sentinels with a password of
their own take ``?sentinel_password=...`` (and ``sentinel_username=...``); without them
the sentinels are asked with none. redis-py has no URL form for Sentinel (this is the
form most tools write); its asyncio ``SentinelConnectionPool`` does the rest: each new
connection asks the sentinels for the primary, and a connection that finds its server
demoted (``READONLY``) is dropped and made again to the new one.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from receiver.redis.wire import guard_connections

__all__ = [
    "DEFAULT_SENTINEL_PORT",
    "SentinelTarget",
    "find_primary",
    "parse_sentinel_url",
    "sentinel_pool",
]

DEFAULT_SENTINEL_PORT = 26379
_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
_QUERY = frozenset({"sentinel_password", "sentinel_username"})


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """What a Sentinel URL names (its secrets kept out of ``repr``)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The Sentinel set, service and database of ``url``; a ValueError that says what is
    wrong (never the URL, which may hold a password)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise ValueError("a Sentinel URL starts with redis+sentinel:// or rediss+sentinel://")
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    sentinels = tuple(_host_port(h) for h in hosts.split(",") if h)
    if not sentinels:
        raise ValueError("a Sentinel URL names at least one sentinel: host[:port][,host[:port]]")
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError("a Sentinel URL's path is /service or /service/db (the monitored name)")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError("the database in a Sentinel URL's path must be a number")
        db = int(parts[1])
    options = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - _QUERY)
    if unknown:
        raise ValueError(
            f"a Sentinel URL takes only {', '.join(sorted(_QUERY))} as query parameters "
            f"(not {', '.join(unknown)})"
        )
    return SentinelTarget(
        sentinels,
        urllib.parse.unquote(parts[0]),
        db,
        _SCHEMES[scheme.lower()],
        username,
        password,
        options.get("sentinel_username") or None,
        options.get("sentinel_password") or None,
    )


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:26379
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError("a sentinel in a Sentinel URL has no host")
    if port and not port.isdigit():
        raise ValueError("a sentinel's port in a Sentinel URL must be a number")
    return host, int(port) if port else DEFAULT_SENTINEL_PORT


class _Pool(SentinelConnectionPool):
    """redis-py's Sentinel pool, which also closes its sentinels' connections."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        for sentinel in self.sentinel_manager.sentinels:
            await sentinel.connection_pool.disconnect()


def sentinel_pool(url: str, options: Mapping[str, Any]) -> SentinelConnectionPool:
    """A pool of connections to the primary the sentinels of ``url`` name (the scheme
    table's row for ``redis+sentinel`` and ``rediss+sentinel``): ``options`` (the role's
    timeouts) apply to the primary and to the sentinels alike."""
    target = parse_sentinel_url(url)
    timeouts = {k: v for k, v in options.items() if k.startswith("socket_")}
    asked: dict[str, Any] = {**timeouts, "ssl": target.tls}
    if target.sentinel_password is not None:
        asked["password"] = target.sentinel_password
    if target.sentinel_username is not None:
        asked["username"] = target.sentinel_username
    manager = Sentinel(list(target.sentinels), sentinel_kwargs=asked)  # type: ignore[no-untyped-call]
    pool = _Pool(  # type: ignore[no-untyped-call]
        target.service,
        manager,
        db=target.db,
        username=target.username,
        password=target.password,
        ssl=target.tls,
        **options,
    )
    guard_connections(pool)
    return pool


async def find_primary(url: str, *, timeout_s: float = 2.0) -> str:
    """Which primary the sentinels of ``url`` name now, and its replicas, in words (what
    ``nopoll config check`` prints); why not, when no sentinel answers."""
    target = parse_sentinel_url(url)
    pool = sentinel_pool(url, {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s})
    manager = pool.sentinel_manager
    where = f"Sentinel service {target.service!r} ({len(target.sentinels)} sentinel(s))"
    try:
        host, port = await manager.discover_master(target.service)
        replicas = await manager.discover_slaves(target.service)
    except Exception as exc:  # a line for the user, never a crash of the check
        return f"{where}: no primary found ({type(exc).__name__}: {str(exc)[:120]})"
    finally:
        await pool.disconnect()
    return f"{where}: primary {host}:{port}, {len(replicas)} replica(s)"
