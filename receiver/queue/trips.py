"""The hot path's outgoing wire: pipelined Redis round trips (:class:`RoundTrips`), many
commands in one write, their replies read back under one deadline, on a connection held
from one trip to the next."""

from __future__ import annotations

import asyncio
from typing import Any

from redis import __version__ as redis_version
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:
    import hiredis

    _hiredis_pack: Any = getattr(hiredis, "pack_command", None)
except ImportError:  # pragma: no cover - arq installs redis[hiredis]
    _hiredis_pack = None

__all__ = ["RoundTrips"]


class RoundTrips:
    """Pipelined Redis round trips: every command of a trip in one write, the replies read
    back in order (a ``ResponseError`` is returned in its command's place, not raised).

    redis-py's own pipeline packs each command in Python (~16 us for an ``EVALSHA``, hiredis
    takes ~1), sets a timer per reply, and checks a pooled connection out and in around
    every trip, which costs a turn of the event loop. Here one deadline covers the trip,
    and the connection is held for the next trip (at most as many as trips run at once).
    A held connection that turns out broken (Redis restarted while it was idle) is dropped
    and the trip sent once more on a fresh one: only for commands that may run twice (a
    second run of the enqueue script answers DUPLICATE). Replies are read with redis-py's
    parser directly (``_parser``), which nopoll's supported redis versions share.
    """

    def __init__(self, redis: Redis) -> None:
        self._pool = redis.connection_pool
        self._held: list[AbstractConnection] = []

    async def run(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands``, return their replies; a broken trip raises a RedisError."""
        conn = self._held.pop() if self._held else None
        if conn is not None:
            try:
                return await self._trip(conn, commands)
            except RedisConnectionError:
                pass  # stale: Redis closed it while it sat here
        conn = await self._pool.get_connection(*_GET_CONNECTION_ARGS)
        return await self._trip(conn, commands)

    async def _trip(self, conn: AbstractConnection, commands: list[tuple[Any, ...]]) -> list[Any]:
        try:
            packed = [part for c in commands for part in _pack(conn, c)]
            await conn.send_packed_command(packed, check_health=False)
            parser: Any = conn._parser
            async with asyncio.timeout(conn.socket_timeout):
                replies = [await parser.read_response() for _ in commands]
        except BaseException as exc:
            await conn.disconnect()
            await self._pool.release(conn)
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError("Redis did not answer in time") from exc
            if isinstance(exc, OSError):
                raise RedisConnectionError(f"Redis connection failed: {exc}") from exc
            raise
        self._held.append(conn)
        return replies


# redis-py 5.3 deprecated get_connection's command name argument; older ones require it.
_GET_CONNECTION_ARGS: tuple[str, ...] = (
    () if tuple(int(p) for p in redis_version.split(".")[:2]) >= (5, 3) else ("EVALSHA",)
)


def _pack(conn: Any, command: tuple[Any, ...]) -> list[bytes]:
    if _hiredis_pack is not None:
        return [_hiredis_pack(command)]
    return list(conn.pack_command(*command))
