"""``?wait``: hold a request until its result lands, with no polling.

:class:`Landings` is one pub/sub subscription per API process on
:data:`sinks.results.CHANNEL`, shared by every waiting request: for the keys someone
waits for, it reads the landed envelopes (one ``MGET`` for the keys that landed together)
and hands them over. A request reads its key once after registering, and every awaited
key is read again after each (re)subscription, so no landing is missed. The subscription
lives from the first waiter to the last, and is made again with backoff when it breaks.

See docs/consumers.md (one result).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from receiver.backoff import Backoff
from receiver.redis.link import RedisLink
from receiver.results.stream import whole
from sinks.results import CHANNEL

__all__ = ["Landings", "Waiter"]

log = logging.getLogger("nopoll.results")

_IDLE_READ_S = 30.0
"""How long one read of the subscription waits for a message (a health check follows)."""
_MGET = 500
"""Keys per read of landed envelopes."""


class Waiter:
    """One waiting request: given its envelope when it lands, or abandoned when its client
    goes away."""

    __slots__ = ("_event", "gone", "value")

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.gone = False
        self.value: bytes | None = None

    def land(self, value: bytes) -> None:
        self.value = value
        self._event.set()

    def abandon(self) -> None:
        """The client disconnected: stop waiting."""
        self.gone = True
        self._event.set()

    async def sleep(self) -> None:
        """Until :meth:`land` or :meth:`abandon`."""
        await self._event.wait()


class Landings:
    """The process's one subscription to landing notifications (see the module docs)."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._waiters: dict[bytes, set[Waiter]] = {}
        self._task: asyncio.Task[None] | None = None
        self._subscribed = False
        self._due: set[bytes] = set()
        self._reader: asyncio.Task[None] | None = None
        self._link = RedisLink("results API (wait)")
        self._backoff = Backoff(0.1, 5.0)

    @property
    def waiting(self) -> int:
        """Requests waiting right now."""
        return sum(len(w) for w in self._waiters.values())

    async def wait(self, key: str, timeout_s: float, waiter: Waiter | None = None) -> bytes | None:
        """The value at ``key`` once it is set (within ``timeout_s``), else None; also None
        once ``waiter`` is abandoned. Raises RedisError when Redis cannot be read. When the
        time ran out before the subscription was up (a wait shorter than subscribing, or
        a broken subscription), ``key`` is read once more: that read is the answer."""
        waiter = waiter or Waiter()
        name = key.encode()
        self._waiters.setdefault(name, set()).add(waiter)
        if self._task is None:
            self._task = asyncio.create_task(self._listen(), name="results API: landings")
        try:
            async with asyncio.timeout(timeout_s):
                if self._subscribed:  # else the subscription reads it once it is made
                    value: bytes | None = await whole(self._redis.get(name))
                    if value is not None:
                        return value
                while waiter.value is None and not waiter.gone:
                    await waiter.sleep()
                return waiter.value
        except TimeoutError:
            pass
        finally:
            self._forget(name, waiter)
        if self._subscribed or waiter.gone:
            return None
        # not subscribed: a landing may have gone unnoticed, and Redis may be down
        last: bytes | None = await whole(self._redis.get(name))
        return last

    def _forget(self, name: bytes, waiter: Waiter) -> None:
        waiters = self._waiters.get(name)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[name]
        if not self._waiters:  # the last waiter left: unsubscribe
            for task in (self._task, self._reader):
                if task is not None:
                    task.cancel()
            self._task = self._reader = None
            self._due.clear()

    def _landed(self, names: set[bytes] | list[bytes]) -> None:
        """Read these keys (those someone waits for) soon, together."""
        self._due.update(n for n in names if n in self._waiters)
        if self._due and self._reader is None:
            self._reader = asyncio.create_task(self._read(), name="results API: landed")

    async def _read(self) -> None:
        try:
            attempt = 0
            while self._due and self._waiters:
                names = [n for n in self._due if n in self._waiters][:_MGET]
                self._due.difference_update(names)
                try:
                    values = await whole(self._redis.mget(names)) if names else []
                except (RedisError, OSError) as exc:
                    self._link.lost(exc)
                    self._due.update(names)  # again, until their waiters give up
                    attempt += 1
                    await asyncio.sleep(self._backoff.delay(attempt))
                    continue
                attempt = 0
                for name, value in zip(names, values, strict=True):
                    if value is not None:
                        for waiter in self._waiters.get(name, ()):
                            waiter.land(value)
        finally:
            if self._reader is asyncio.current_task():
                self._reader = None

    async def _listen(self) -> None:
        attempt = 0
        while True:
            pubsub = self._redis.pubsub()
            try:
                await self._subscribe(pubsub)
                attempt = 0
                while True:
                    message = await pubsub.get_message(timeout=_IDLE_READ_S)
                    if message is not None and message["type"] == "message":
                        self._landed([message["data"]])
            except (RedisError, OSError) as exc:
                self._link.lost(exc)
            finally:
                if self._task in (None, asyncio.current_task()):  # not a newer one's
                    self._subscribed = False
                with contextlib.suppress(RedisError, OSError):
                    await asyncio.shield(pubsub.aclose())  # type: ignore[no-untyped-call]
            attempt += 1
            await asyncio.sleep(self._backoff.delay(attempt))

    async def _subscribe(self, pubsub: PubSub) -> None:
        """Subscribe and wait for the confirmation; then read every awaited key."""
        await pubsub.subscribe(CHANNEL)
        for _ in range(100):  # bounded: the confirmation is the first message
            message = await pubsub.get_message(timeout=_IDLE_READ_S)
            if message is not None and message["type"] == "subscribe":
                break
        else:
            raise RedisError("no confirmation of the subscription")
        self._subscribed = True
        self._link.back()
        self._landed(list(self._waiters))  # a result may have landed while nobody listened
