"""Dead letters: work that failed every retry, kept in Redis until replayed.

A dead letter holds everything needed to redo the work: the arq function and its
arguments (a fetch, or a sink delivery with its envelopes), the keys it concerns, how
many attempts it took and the last error. ``nopoll dlq list`` shows them,
``nopoll dlq replay`` queues each one again on the queue of its own function (a batch
fetch on the batch queue) and forgets it in the same atomic step, so a letter is either
still kept or its job is durably queued, never neither.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from redis.asyncio import Redis

from nopoll.envelope import DEFAULT_TENANT
from receiver.journey.store import JourneyStore
from receiver.providers.client import provider_said
from receiver.queue.enqueue import PUT_JOB_LUA
from receiver.queue.jobs import QueuedJob, journeys_of, letter_target

__all__ = ["REPLAY_PREFIX", "DeadLetter", "DeadLetters", "journeys_of", "letter_tenant"]

log = logging.getLogger("nopoll.dlq")

_DATA = "nopoll:dlq"
_INDEX = "nopoll:dlq:index"
_BY_SINK = "nopoll:dlq:sinks"
"""hash: sink -> how many of its letters are kept (what ``nopoll_dead_letters_kept`` shows
without reading the letters; letters kept before it existed are not in it)."""
REPLAY_PREFIX = "replay:"
"""The job id prefix of a replayed letter's job: its failing again is not a new letter."""
_REPLAY_LUA = (
    PUT_JOB_LUA
    + """
put_job(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
-- a letter kept before the count existed is not in it: never below zero
if redis.call('HDEL', KEYS[4], ARGV[5]) == 1
   and tonumber(redis.call('HGET', KEYS[6], ARGV[6]) or '0') > 0 then
  redis.call('HINCRBY', KEYS[6], ARGV[6], -1)
end
redis.call('ZREM', KEYS[5], ARGV[5])
return 1
"""
)
_REPLAY_EXPIRY_MS = 7 * 86_400 * 1000
_SLICE = 1000


@dataclass(slots=True)
class DeadLetter:
    """One piece of failed work."""

    id: str
    sink: str
    """The sink that failed, or ``fetch`` when the provider fetch itself failed."""
    provider: str
    keys: list[str]
    attempts: int
    error: str
    function: str
    kwargs: dict[str, Any]
    created_at: float = field(default_factory=time.time)

    @property
    def tenant(self) -> str:
        """The tenant whose work this is (:func:`letter_tenant`)."""
        return letter_tenant(self.kwargs)


def letter_tenant(kwargs: dict[str, Any]) -> str:
    """The tenant of a dead letter's work, read from the work itself: a delivery's
    envelopes' ``tenant`` (one tenant's results per delivery: a batch chunk or one
    fetch's), a fetch's ``tenant`` kwarg, or the ``provider@tenant`` a fetch known only
    by its job id names; ``default`` when none says otherwise."""
    envelopes = kwargs.get("envelopes")
    if isinstance(envelopes, list) and envelopes and isinstance(envelopes[0], dict):
        return str(envelopes[0].get("tenant") or DEFAULT_TENANT)
    tenant = kwargs.get("tenant")
    if isinstance(tenant, str) and tenant:
        return tenant
    _, at, scope = str(kwargs.get("provider", "")).partition("@")
    return scope if at and scope else DEFAULT_TENANT


def _of_sink(data: bytes, sink: str, field: bytes) -> bool:
    if data.startswith(b'{"id":"') and data[39:41] == b'",':
        return data[41 : 41 + len(field)] == field
    return bool(orjson.loads(data).get("sink") == sink)


_ERROR_CHARS = 2000


def _cut(error: str) -> str:
    """``error`` within 2,000 characters, the provider's own reason at its end kept whole
    (what is cut is the middle of nopoll's part)."""
    if len(error) <= _ERROR_CHARS:
        return error
    head, said = provider_said(error)
    tail = error[len(head) :]
    if said is None or len(tail) > _ERROR_CHARS // 2:
        return error[:_ERROR_CHARS]
    return error[: _ERROR_CHARS - len(tail) - 1] + "\u2026" + tail


class DeadLetters:
    """The dead-letter store on the shared Redis. With a ``journey`` store, each letter kept
    or replayed is also an event on the journeys of its work."""

    def __init__(self, redis: Redis, *, journey: JourneyStore | None = None) -> None:
        self._redis = redis
        self._journey = journey

    async def add(
        self,
        *,
        sink: str,
        provider: str,
        keys: list[str],
        attempts: int,
        error: str,
        function: str,
        kwargs: dict[str, Any],
    ) -> DeadLetter:
        """Keep failed work; returns the stored dead letter."""
        letter = DeadLetter(
            id=uuid.uuid4().hex,
            sink=sink,
            provider=provider,
            keys=keys,
            attempts=attempts,
            error=_cut(error),
            function=function,
            kwargs=kwargs,
        )
        return await self._put(letter)

    async def keep(
        self, function: str, kwargs: dict[str, Any], *, attempts: int, error: str
    ) -> DeadLetter:
        """Keep the failed work of a job, filed under what its :data:`~receiver.queue.jobs.JOBS`
        row says of it (:meth:`~receiver.queue.jobs.JobSpec.letter_target`; ``fetch`` when
        no sink is named)."""
        sink, provider, keys = letter_target(function, kwargs)
        filed = (sink or "fetch", provider, keys, attempts, _cut(error), function, kwargs)
        return await self._put(DeadLetter(uuid.uuid4().hex, *filed))

    async def _put(self, letter: DeadLetter) -> DeadLetter:
        """Store ``letter`` (and its event on its work's journeys)."""
        sink = letter.sink
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(_DATA, letter.id, orjson.dumps(asdict(letter)).decode())
            pipe.zadd(_INDEX, {letter.id: letter.created_at})
            pipe.hincrby(_BY_SINK, sink, 1)
            if self._journey is not None:
                for p, tenant, object_id in journeys_of(letter.function, letter.kwargs):
                    self._journey.add_to(
                        pipe,
                        p,
                        object_id,
                        "dead_letter",
                        tenant,
                        letter=letter.id,
                        sink=sink,
                        error=letter.error[:500],
                    )
            await pipe.execute()
        return letter

    async def find(
        self, *, sink: str | None = None, key: str | None = None, tenant: str | None = None
    ) -> list[DeadLetter]:
        """Dead letters, oldest first, optionally only one sink's, one key's or one
        tenant's."""
        ids = await self._redis.zrange(_INDEX, 0, -1)
        if not ids:
            return []
        raw: list[bytes | None] = await self._redis.hmget(_DATA, ids)  # type: ignore[misc]
        letters = [DeadLetter(**orjson.loads(r)) for r in raw if r is not None]
        return [
            d
            for d in letters
            if (sink is None or d.sink == sink)
            and (key is None or key in d.keys)
            and (tenant is None or d.tenant == tenant)
        ]

    async def get(self, ids: list[str]) -> list[DeadLetter]:
        """The dead letters with these ids (unknown ids are left out)."""
        if not ids:
            return []
        raw: list[bytes | None] = await self._redis.hmget(_DATA, ids)  # type: ignore[misc]
        return [DeadLetter(**orjson.loads(r)) for r in raw if r is not None]

    async def page(
        self,
        *,
        offset: int = 0,
        limit: int = 50,
        sink: str | None = None,
        tenant: str | None = None,
    ) -> tuple[list[DeadLetter], int]:
        """Newest first: ``limit`` letters from ``offset`` (of one sink's and one tenant's,
        if given), and how many there are in all. Without a filter it reads only the page;
        with one it reads the index in slices of 1,000 to the end (to count)."""
        if sink is None and tenant is None:
            total = int(await self._redis.zcard(_INDEX))
            ids = await self._redis.zrevrange(_INDEX, offset, offset + limit - 1)
            return await self.get([i.decode() for i in ids]), total
        page: list[DeadLetter] = []
        matched = 0
        # A letter is stored as {"id":"<32 hex>","sink":"<name>",...}: its sink is read
        # at that place without decoding it (letters in any other shape are decoded). Its
        # tenant is in its work, so a tenant's filter decodes every letter of the sink.
        field = orjson.dumps({"sink": sink})[1:-1] + b"," if sink is not None else b""
        async for data in self._every():
            if sink is not None and not _of_sink(data, sink, field):
                continue
            letter = DeadLetter(**orjson.loads(data)) if tenant is not None else None
            if letter is not None and letter.tenant != tenant:
                continue
            if offset <= matched < offset + limit:
                page.append(letter or DeadLetter(**orjson.loads(data)))
            matched += 1
        return page, matched

    async def by_tenant(self) -> dict[str, int]:
        """How many letters each tenant has kept (every letter is read: a page's cost
        times the letters kept, like a filtered :meth:`page`)."""
        counts: dict[str, int] = {}
        async for data in self._every():
            kwargs = orjson.loads(data).get("kwargs")
            tenant = letter_tenant(kwargs if isinstance(kwargs, dict) else {})
            counts[tenant] = counts.get(tenant, 0) + 1
        return counts

    async def _every(self) -> AsyncIterator[bytes]:
        """Every stored letter, newest first, read in slices of 1,000."""
        size = int(await self._redis.zcard(_INDEX))
        for start in range(0, size, _SLICE):
            ids = await self._redis.zrevrange(_INDEX, start, start + _SLICE - 1)
            if not ids:
                return
            raw: list[bytes | None] = await self._redis.hmget(_DATA, ids)  # type: ignore[misc]
            for data in raw:
                if data is not None:
                    yield data

    async def replay(self, letters: list[DeadLetter]) -> int:
        """Queue each dead letter's work again (from try 1) on its function's queue and forget
        it in the same atomic step; returns how many. A letter whose work is gone (a delivery
        whose payload expired) is kept and listed, never queued where nothing would run it."""
        done = 0
        for letter in letters:
            job = QueuedJob(letter.function, f"{REPLAY_PREFIX}{letter.id}", letter.kwargs)
            try:
                job.queue  # noqa: B018 - a function nothing runs must not be queued
            except ValueError:
                log.warning("dead letter %s cannot be replayed: %s", letter.id, letter.error)
                continue
            await self._redis.eval(  # type: ignore[misc]
                _REPLAY_LUA,
                6,
                *job.keys(),
                _DATA,
                _INDEX,
                _BY_SINK,
                *job.args(_REPLAY_EXPIRY_MS),
                letter.id,
                letter.sink,
            )
            done += 1
            if self._journey is not None:
                for p, tenant, object_id in journeys_of(letter.function, letter.kwargs):
                    await self._journey.record(p, object_id, "replay", tenant, letter=letter.id)
        return done

    async def of_journey(self, provider: str, object_id: str, tenant: str) -> list[DeadLetter]:
        """The letters kept for one journey's work (every letter is read: a page's worth
        of dead letters is what an operator looks at)."""
        target = (provider, tenant, object_id)
        return [d for d in await self.find() if target in journeys_of(d.function, d.kwargs)]

    async def count(self) -> int:
        """How many dead letters are kept."""
        return int(await self._redis.zcard(_INDEX))

    async def kept_by_sink(self) -> dict[str, int]:
        """How many letters each sink has kept (one small hash read: cheap at scrape time)."""
        raw = await self._redis.hgetall(_BY_SINK)  # type: ignore[misc]
        return {k.decode(): int(v) for k, v in raw.items() if int(v) > 0}
