"""The hot paths' outgoing wire: pipelined Redis round trips (:class:`RoundTrips`), many
commands in one write, their replies read back under one deadline, on a connection held
from one trip to the next; and :class:`SharedTrips`, which lets concurrent callers (the
API's callbacks, the worker's jobs) share those trips."""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from receiver.redis.wire import read_replies, send_commands, take_connection

__all__ = ["UNBOUNDED", "NotPrimary", "RoundTrips", "SharedTrips", "Trailer", "TripsBusy"]

_NOT_PRIMARY = ("READONLY", "MASTERDOWN", "LOADING", "NOREPLICAS")
"""Error replies of a server that cannot take writes now: a primary demoted by a failover
(it may still answer, with stale data), a replica without its primary, one loading its
data, a primary short of the replicas its ``min-replicas-to-write`` asks for."""


class NotPrimary(RedisConnectionError):
    """The server answered as one that cannot take writes now (a failover is under way):
    the connection is dropped, and the pool's next connection looks for the primary
    again (a Sentinel pool asks the sentinels; a URL resolves its host again)."""


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
    parser directly (:mod:`receiver.redis.wire`).
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
        conn = await take_connection(self._pool)
        return await self._trip(conn, commands)

    async def _trip(self, conn: AbstractConnection, commands: list[tuple[Any, ...]]) -> list[Any]:
        try:
            await send_commands(conn, commands)
            replies = await read_replies(conn, len(commands))
        except BaseException as exc:
            await conn.disconnect()
            await self._pool.release(conn)
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError("Redis did not answer in time") from exc
            if isinstance(exc, OSError):
                raise RedisConnectionError(f"Redis connection failed: {exc}") from exc
            raise
        refused = _not_primary(replies)
        if refused is not None:  # held open, it would keep talking to the old primary
            await conn.disconnect()
            await self._pool.release(conn)
            await self._pool.disconnect(inuse_connections=False)
            raise NotPrimary(f"Redis cannot take writes now ({refused}): looking for the primary")
        self._held.append(conn)
        return replies


def _not_primary(replies: list[Any]) -> str | None:
    """The first word of a reply that says the server cannot take writes now, if any."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            word = str(reply).split(" ", 1)[0]
            if word in _NOT_PRIMARY:
                return word
    return None


_MIN_TRIP = 16
UNBOUNDED = 2**62
"""``max_pending`` for callers that bound themselves (a worker's own jobs)."""
"""Callers per round trip before pending ones are split over several trips in flight."""


class SharedTrips:
    """Concurrent callers' Redis commands share pipelined round trips (:class:`RoundTrips`):
    up to ``max_in_flight`` trips at once, each carrying the commands of up to
    ``max_batch`` callers. Callers that arrive while every trip is in flight wait for the
    next one to leave; at most ``max_pending`` of them (default: one more full trip per
    trip in flight): beyond that :meth:`run` raises :class:`TripsBusy` at once.

    A caller hands in its commands and gets their replies, in order, a ``ResponseError``
    in its command's place (never raised); a trip that breaks (Redis down, a timeout)
    raises its ``RedisError`` to each of its callers. Scripts go as ``EVALSHA`` of their
    source's digest (:meth:`evalsha`): a Redis that lost its script cache (restarted)
    answers ``NOSCRIPT``, and those commands are sent again once the scripts are loaded.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        max_batch: int = 512,
        max_in_flight: int = 4,
        max_pending: int | None = None,
        trailer: Trailer | None = None,
    ) -> None:
        self._redis = redis
        self._trailer = trailer
        self._trips = RoundTrips(redis)
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._max_pending = max_batch * max_in_flight if max_pending is None else max_pending
        self._scripts: dict[str, str] = {}
        """Each script's source by its SHA1 digest (to load it again)."""
        self._digests: dict[str, str] = {}
        """Each script's SHA1 digest by its source: worked out once, not per call."""
        self._pending: deque[_Caller] = deque()
        self._flushers: set[asyncio.Task[None]] = set()
        self._starter: asyncio.Task[None] | None = None  # started, has not taken its callers

    @property
    def pending(self) -> int:
        """Callers waiting for a trip to leave."""
        return len(self._pending)

    def evalsha(self, source: str, numkeys: int, *keys_and_args: Any) -> tuple[Any, ...]:
        """The command that runs the Lua ``source`` (by its digest; see the class docs)."""
        return ("EVALSHA", self.digest(source), str(numkeys), *keys_and_args)

    def digest(self, source: str) -> str:
        """The SHA1 digest an ``EVALSHA`` of the Lua ``source`` names (for a caller that
        builds its own commands on a hot path; a script unknown to Redis is loaded again
        from here)."""
        sha = self._digests.get(source)
        if sha is None:
            sha = self._digests[source] = hashlib.sha1(source.encode()).hexdigest()
            self._scripts[sha] = source
        return sha

    async def run(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` in the next trip; their replies (see the class docs)."""
        reply: list[Any] = await self._join(commands, False)
        return reply

    def run_one(self, command: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Send one command in the next trip; await its reply (the API's hot path: no list
        is made or sliced per caller, no coroutine wraps the wait). Raises
        :class:`TripsBusy` at once, not when awaited."""
        return self._join(command, True)

    def _join(self, commands: Any, one: bool) -> asyncio.Future[Any]:
        if len(self._pending) >= self._max_pending:
            raise TripsBusy(f"{len(self._pending)} callers wait for Redis already")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((commands, future, one))
        self._start_flusher()
        return future

    def _start_flusher(self) -> None:
        if self._starter is None and len(self._flushers) < self._max_in_flight:
            # Started, not run yet: callers in this turn of the event loop join it.
            self._starter = task = asyncio.create_task(self._flush())
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)  # also when cancelled unstarted

    async def _flush(self) -> None:
        me = asyncio.current_task()
        try:
            while self._pending:
                # Several small trips in flight, not one big one that everything waits on.
                share = max(_MIN_TRIP, -(-len(self._pending) // self._max_in_flight))
                take = min(self._max_batch, share, len(self._pending))
                batch = [self._pending.popleft() for _ in range(take)]
                if self._starter is me:
                    self._starter = None
                if self._pending:
                    self._start_flusher()  # the rest leaves in a trip of its own
                await self._settle(batch)
        finally:
            if self._starter is me:
                self._starter = None
            self._flushers.discard(me)

    async def _settle(self, batch: list[_Caller]) -> None:
        sent: list[tuple[Any, ...]] = []
        for commands, _, one in batch:
            if one:
                sent.append(commands)
            else:
                sent.extend(commands)
        trailer = self._trailer
        try:
            if trailer is None:
                replies = await self._send(sent)
            else:  # the trailer's commands end the trip; what they say applies to all of it
                tail = trailer.commands()
                replies = await self._send([*sent, *tail])
                trailer.check(replies[len(sent) :])
                del replies[len(sent) :]
        except Exception as exc:  # this round trip failed: only its callers see it
            for _, future, _ in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:
            for _, future, _ in batch:
                future.cancel()
            raise
        start = 0
        for commands, future, one in batch:
            end = start + 1 if one else start + len(commands)
            if not future.done():
                future.set_result(replies[start] if one else replies[start:end])
            start = end

    async def _send(self, commands: list[tuple[Any, ...]], *, reload: bool = True) -> list[Any]:
        replies = await self._trips.run(commands)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing and reload:
            # Redis restarted and lost its script cache: load them again and redo those.
            for sha in {commands[i][1] for i in missing}:
                await self._redis.script_load(self._scripts[sha])
            redone = await self._send([commands[i] for i in missing], reload=False)
            for i, reply in zip(missing, redone, strict=True):
                replies[i] = reply
        return replies


class Trailer(Protocol):
    """Commands that end every shared trip, and the check of their replies (the API's
    ``WAIT`` for replicas: :class:`receiver.queue.enqueue.ReplicaWait`)."""

    def commands(self) -> list[tuple[Any, ...]]: ...

    def check(self, replies: list[Any]) -> None:
        """Raise (a ``RedisError``) when the trip must count as failed for its callers."""
        ...


_Caller = tuple[Any, "asyncio.Future[Any]", bool]
"""A waiting caller: its commands (one command when the flag is set), its future."""


class TripsBusy(Exception):
    """Too many callers wait for a Redis round trip already."""
