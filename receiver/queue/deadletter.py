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
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from redis.asyncio import Redis

from nopoll.envelope import DEFAULT_TENANT
from receiver.config.sections import DeadLetterConfig
from receiver.journey.store import JourneyStore
from receiver.logs import Throttle
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
_TENANTS = "nopoll:dlq:tenants"
"""hash: tenant -> how many of its letters are kept."""
_TENANT_INDEX = "nopoll:dlq:t:"
"""``nopoll:dlq:t:<tenant>``: sorted set of one tenant's letter ids by time kept."""
_JOURNEY_INDEX = "nopoll:dlq:j:"
"""``nopoll:dlq:j:<tenant>:<provider>:<id>``: set of the letter ids of one journey's work
(expires with the letters; an id whose letter went is skipped when read)."""
_INDEXED = "nopoll:dlq:indexed"
"""Set once the letters kept before the tenant index existed were added to it."""
REPLAY_PREFIX = "replay:"
"""The job id prefix of a replayed letter's job: its failing again is not a new letter."""

# A Lua function: drop letter ``id`` of ``tenant`` (KEYS as _PUT_LUA's 1-5), its counts
# never below zero (letters kept before a count existed are not in it).
_DROP_LUA = """
local function decr(hash, field)
  if tonumber(redis.call('HGET', hash, field) or '0') > 0 then
    redis.call('HINCRBY', hash, field, -1)
  end
end
local function drop(id, tenant)
  local raw = redis.call('HGET', KEYS[1], id)
  if raw then
    local sink = string.match(raw, '"sink":"([^"]*)"')
    if sink then decr(KEYS[3], sink) end
    redis.call('HDEL', KEYS[1], id)
  end
  redis.call('ZREM', KEYS[2], id)
  if redis.call('ZREM', KEYS[4], id) == 1 then decr(KEYS[5], tenant) end
end
-- one tenant's letters older than cutoff (at most 1,000 a call), then its oldest beyond cap
local function trim(tenant, cap, cutoff)
  local expired = {}
  if cutoff ~= '' then
    expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', cutoff, 'LIMIT', 0, 1000)
    for _, id in ipairs(expired) do drop(id, tenant) end
  end
  local over = redis.call('ZCARD', KEYS[4]) - cap
  local capped = {}
  if over > 0 then
    capped = redis.call('ZRANGE', KEYS[4], 0, over - 1)
    for _, id in ipairs(capped) do drop(id, tenant) end
  end
  return {#expired, #capped}
end
"""
# KEYS: 1 data, 2 index, 3 by sink, 4 the tenant's index, 5 by tenant, 6.. journey sets
# ARGV: 1 id, 2 letter JSON, 3 time kept, 4 sink, 5 tenant, 6 cap, 7 cutoff ('' none),
# 8 journey sets' ttl s
_PUT_LUA = (
    _DROP_LUA
    + """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[5], 1)
for i = 6, #KEYS do
  redis.call('SADD', KEYS[i], ARGV[1])
  redis.call('EXPIRE', KEYS[i], ARGV[8])
end
return trim(ARGV[5], tonumber(ARGV[6]), ARGV[7])
"""
)
# KEYS as _PUT_LUA's 1-5; ARGV: 1 tenant, 2 cap, 3 cutoff
_TRIM_LUA = _DROP_LUA + "return trim(ARGV[1], tonumber(ARGV[2]), ARGV[3])\n"
_REPLAY_LUA = (
    PUT_JOB_LUA
    + """
put_job(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
local function decr(hash, field)
  if tonumber(redis.call('HGET', hash, field) or '0') > 0 then
    redis.call('HINCRBY', hash, field, -1)
  end
end
-- a letter kept before the counts existed is not in them: never below zero
if redis.call('HDEL', KEYS[4], ARGV[5]) == 1 then decr(KEYS[6], ARGV[6]) end
redis.call('ZREM', KEYS[5], ARGV[5])
if redis.call('ZREM', KEYS[7], ARGV[5]) == 1 then decr(KEYS[8], ARGV[7]) end
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


def _journey_key(tenant: str, provider: str, object_id: str) -> str:
    return f"{_JOURNEY_INDEX}{tenant}:{provider}:{object_id}"


def _of_sink(data: bytes, sink: str, field: bytes) -> bool:
    if data.startswith(b'{"id":"') and data[39:41] == b'",':
        return data[41 : 41 + len(field)] == field
    return bool(orjson.loads(data).get("sink") == sink)


_DROPS = Throttle(log, every_s=60.0)
"""Dropped letters: one line per tenant and reason a minute (the count is in metrics)."""

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

    def __init__(
        self,
        redis: Redis,
        *,
        journey: JourneyStore | None = None,
        limits: DeadLetterConfig | None = None,
        on_dropped: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self._redis = redis
        self._journey = journey
        self._limits = limits or DeadLetterConfig()
        self._on_dropped = on_dropped
        """Told ``(tenant, reason, n)`` of letters dropped: ``cap`` or ``expired``."""

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
        """Store ``letter`` in its tenant's share (the tenant's oldest beyond its cap and
        its expired ones go, counted), and its event on its work's journeys."""
        sink, tenant = letter.sink, letter.tenant
        journeys = journeys_of(letter.function, letter.kwargs)
        sets = [_journey_key(t, p, object_id) for p, t, object_id in journeys]
        keys = [_DATA, _INDEX, _BY_SINK, _TENANT_INDEX + tenant, _TENANTS, *sets]
        ttl = self._limits.ttl_s
        cutoff = "" if ttl is None else repr(letter.created_at - ttl)
        sets_ttl = ttl if ttl is not None else 400 * 86_400
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.eval(
                _PUT_LUA,
                len(keys),
                *keys,
                letter.id,
                orjson.dumps(asdict(letter)).decode(),
                repr(letter.created_at),
                sink,
                tenant,
                str(self._limits.max_per_tenant),
                cutoff,
                str(sets_ttl),
            )
            if self._journey is not None:
                for p, t, object_id in journeys:
                    self._journey.add_to(
                        pipe,
                        p,
                        object_id,
                        "dead_letter",
                        t,
                        letter=letter.id,
                        sink=sink,
                        error=letter.error[:500],
                    )
            replies = await pipe.execute()
        self._dropped(tenant, replies[0])
        return letter

    def _dropped(self, tenant: str, reply: Any) -> None:
        expired, capped = (int(n) for n in reply)
        for reason, n in (("expired", expired), ("cap", capped)):
            if n:
                _DROPS.log(
                    logging.WARNING,
                    (tenant, reason),
                    "dead letters: %d of tenant %s dropped (%s: dead_letters.%s)",
                    n,
                    tenant,
                    reason,
                    "ttl_s" if reason == "expired" else "max_per_tenant",
                )
                if self._on_dropped is not None:
                    self._on_dropped(tenant, reason, n)

    async def expire(self) -> None:
        """Drop every tenant's letters that are past ``ttl_s`` or beyond its cap (what a
        worker runs every minute; a tenant that keeps no new letter is trimmed here). The
        first run that finds letters also files those kept before the tenant index."""
        if await self._redis.zcard(_INDEX) and not await self._redis.exists(_INDEXED):
            await self._index_old_letters()
        ttl = self._limits.ttl_s
        cutoff = "" if ttl is None else repr(time.time() - ttl)
        tenants = await self._redis.hkeys(_TENANTS)  # type: ignore[misc]
        for raw in tenants:
            tenant = raw.decode()
            keys = [_DATA, _INDEX, _BY_SINK, _TENANT_INDEX + tenant, _TENANTS]
            reply = await self._redis.eval(  # type: ignore[misc]
                _TRIM_LUA, len(keys), *keys, tenant, str(self._limits.max_per_tenant), cutoff
            )
            self._dropped(tenant, reply)

    async def _index_old_letters(self) -> None:
        """File every letter kept before the tenant index existed under its tenant."""
        async for data in self._every():
            letter = orjson.loads(data)
            kwargs = letter.get("kwargs")
            tenant = letter_tenant(kwargs if isinstance(kwargs, dict) else {})
            added = await self._redis.zadd(
                _TENANT_INDEX + tenant, {letter["id"]: float(letter.get("created_at") or 0)}
            )
            if added:
                await self._redis.hincrby(_TENANTS, tenant, 1)  # type: ignore[misc]
        await self._redis.set(_INDEXED, "1")

    async def find(
        self, *, sink: str | None = None, key: str | None = None, tenant: str | None = None
    ) -> list[DeadLetter]:
        """Dead letters, oldest first, optionally only one sink's, one key's or one
        tenant's (read from that tenant's index: at most its cap)."""
        index = _INDEX if tenant is None else _TENANT_INDEX + tenant
        ids = await self._redis.zrange(index, 0, -1)
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
        if given), and how many there are in all. Without a sink it reads only the page
        (of the tenant's index, with one); with a sink it reads the index in slices of
        1,000 to the end, to count (a tenant's: at most its cap)."""
        index = _INDEX if tenant is None else _TENANT_INDEX + tenant
        if sink is None:
            total = int(await self._redis.zcard(index))
            ids = await self._redis.zrevrange(index, offset, offset + limit - 1)
            return await self.get([i.decode() for i in ids]), total
        page: list[DeadLetter] = []
        matched = 0
        # A letter is stored as {"id":"<32 hex>","sink":"<name>",...}: its sink is read
        # at that place without decoding it (letters in any other shape are decoded).
        field = orjson.dumps({"sink": sink})[1:-1] + b","
        async for data in self._every(index):
            if not _of_sink(data, sink, field):
                continue
            if offset <= matched < offset + limit:
                page.append(DeadLetter(**orjson.loads(data)))
            matched += 1
        return page, matched

    async def by_tenant(self) -> dict[str, int]:
        """How many letters each tenant has kept (one small hash read)."""
        raw = await self._redis.hgetall(_TENANTS)  # type: ignore[misc]
        return {k.decode(): int(v) for k, v in raw.items() if int(v) > 0}

    async def _every(self, index: str = _INDEX) -> AsyncIterator[bytes]:
        """Every letter of ``index``, newest first, read in slices of 1,000."""
        size = int(await self._redis.zcard(index))
        for start in range(0, size, _SLICE):
            ids = await self._redis.zrevrange(index, start, start + _SLICE - 1)
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
                8,
                *job.keys(),
                _DATA,
                _INDEX,
                _BY_SINK,
                _TENANT_INDEX + letter.tenant,
                _TENANTS,
                *job.args(_REPLAY_EXPIRY_MS),
                letter.id,
                letter.sink,
                letter.tenant,
            )
            done += 1
            if self._journey is not None:
                for p, tenant, object_id in journeys_of(letter.function, letter.kwargs):
                    await self._journey.record(p, object_id, "replay", tenant, letter=letter.id)
        return done

    async def of_journey(self, provider: str, object_id: str, tenant: str) -> list[DeadLetter]:
        """The letters kept for one journey's work (its own set of letter ids: nothing
        else is read)."""
        target = (provider, tenant, object_id)
        members = await self._redis.smembers(_journey_key(tenant, provider, object_id))  # type: ignore[misc]
        letters = await self.get(sorted(m.decode() for m in members))
        letters.sort(key=lambda d: d.created_at)
        return [d for d in letters if target in journeys_of(d.function, d.kwargs)]

    async def count(self) -> int:
        """How many dead letters are kept."""
        return int(await self._redis.zcard(_INDEX))

    async def kept_by_sink(self) -> dict[str, int]:
        """How many letters each sink has kept (one small hash read: cheap at scrape time)."""
        raw = await self._redis.hgetall(_BY_SINK)  # type: ignore[misc]
        return {k.decode(): int(v) for k, v in raw.items() if int(v) > 0}
