"""The one module that reaches into redis-py below its public API.

:class:`~receiver.queue.trips.RoundTrips` writes a trip's packed commands in one send and
reads the replies straight off the connection's parser (``_parser``), which every redis
version nopoll supports shares; the version differences of taking a connection from a
pool live here too. Nothing else touches a redis-py private attribute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis import __version__ as redis_version
from redis.asyncio import ConnectionPool
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

try:
    import hiredis

    _hiredis_pack: Any = getattr(hiredis, "pack_command", None)
except ImportError:  # pragma: no cover - arq installs redis[hiredis]
    _hiredis_pack = None

__all__ = ["guard_connections", "read_replies", "send_commands", "take_connection"]

# redis-py 5.3 deprecated get_connection's command name argument; older ones require it.
_GET_CONNECTION_ARGS: tuple[str, ...] = (
    () if tuple(int(p) for p in redis_version.split(".")[:2]) >= (5, 3) else ("EVALSHA",)
)


async def take_connection(pool: ConnectionPool) -> AbstractConnection:
    """A connection of ``pool`` (give it back with ``pool.release``)."""
    conn: AbstractConnection = await pool.get_connection(*_GET_CONNECTION_ARGS)
    return conn


async def send_commands(conn: AbstractConnection, commands: Sequence[tuple[Any, ...]]) -> None:
    """Write ``commands`` in one send (packed by hiredis when it can)."""
    if _hiredis_pack is not None:
        packed = [_hiredis_pack(c) for c in commands]
    else:
        packed = [part for c in commands for part in conn.pack_command(*c)]
    await conn.send_packed_command(packed, check_health=False)


async def read_replies(
    conn: AbstractConnection, count: int, *, within_s: float | None = None
) -> list[Any]:
    """The next ``count`` replies on ``conn``, all within ``within_s`` (default: its
    socket timeout); a ``ResponseError`` comes back in its command's place."""
    parser: Any = conn._parser
    async with asyncio.timeout(conn.socket_timeout if within_s is None else within_s):
        return [await parser.read_response() for _ in range(count)]


_GUARDED: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def guard_connections(pool: ConnectionPool) -> ConnectionPool:
    """Make ``pool``'s connections raise a ``ConnectionError`` where a write to a socket
    the server just closed raises ``RuntimeError`` (uvloop's "handler is closed", seen when
    a server accepts a connection and drops it at once, as one cut off by a partition
    does): every caller already takes a ConnectionError for "Redis is away, retry"."""
    base = pool.connection_class
    guarded = _GUARDED.get(base)
    if guarded is None:

        class Guarded(base):  # type: ignore[valid-type,misc]
            async def connect(self) -> None:
                try:
                    await super().connect()
                except RuntimeError as exc:
                    await self.disconnect()
                    raise RedisConnectionError(f"Redis connection broke: {exc}") from exc

            async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
                try:
                    await super().send_packed_command(*args, **kwargs)
                except RuntimeError as exc:
                    await self.disconnect()
                    raise RedisConnectionError(f"Redis connection broke: {exc}") from exc

        Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
        guarded = _GUARDED[base] = Guarded
    pool.connection_class = guarded
    return pool
