"""The queue between the web app and the worker: arq's job format on Redis.

One Lua script enqueues a callback atomically: it remembers the ``webhook-id`` (a
duplicate answers 200 and enqueues nothing), skips a response already queued or running,
and writes the job as arq's ``enqueue_job`` does, in JSON, never pickle.
:class:`Enqueuer` coalesces concurrent enqueues into pipelined round trips (one
``EVALSHA`` per request); beyond a bound of waiting requests it raises
:class:`QueueBusy` (503, the provider retries).

See docs/capacity.md (how webhook-ids are remembered) and docs/architecture.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from enum import IntEnum
from hashlib import blake2b
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from receiver.journey.store import PUSH_LUA, callback_head, hook_key, journey_key
from receiver.queue._arq import JOB_KEY, RESULT_KEY, RING_LUA, job_payload
from receiver.queue.jobs import (
    BATCHES_QUEUE,
    DELIVER,
    FETCH_BATCH,
    FETCH_RESPONSE,
    JOBS_QUEUE,
    CallbackJob,
    QueuedJob,
    batch_job_id,
    queue_for,
    response_job_id,
)
from receiver.queue.trips import SharedTrips, TripsBusy

__all__ = [
    "BATCHES_QUEUE",
    "DELIVER",
    "FENCE_KEY",
    "FETCH_BATCH",
    "FETCH_RESPONSE",
    "HEALTH_CHECK_KEY",
    "JOBS_QUEUE",
    "PUT_JOB_LUA",
    "CallbackJob",
    "EnqueueOutcome",
    "Enqueuer",
    "NotReplicated",
    "QueueBusy",
    "QueuedJob",
    "ReplicaWait",
    "batch_job_id",
    "id_digest",
    "put_job",
    "queue_for",
    "response_job_id",
]

log = logging.getLogger("nopoll.app")

HEALTH_CHECK_KEY = JOBS_QUEUE + ":health-check"
"""Written by workers every ``worker.health_check_interval_s`` (arq's health check)."""
SEEN_PREFIX = "nopoll:seen:"


PUT_JOB_LUA = (
    RING_LUA
    + """
local function put_job(job_key, result_key, queue, payload, expiry_ms, score, job_id)
  if redis.call('EXISTS', job_key, result_key) > 0 then return 0 end
  redis.call('SET', job_key, payload, 'PX', expiry_ms)
  redis.call('ZADD', queue, score, job_id)
  ring(queue)
  return 1
end
"""
)
"""A Lua function other scripts include: arq's ``enqueue_job`` (skip when a job or result
with that id exists, else the job key and its score), then the queue's bell rung, so a
job can be queued in the same atomic step as the state change that asks for it and an
idle worker takes it at once."""

# The dedupe step, seen(): true when the id was first seen less than the window ago, else
# it is remembered now. Keys: nopoll:seen:@<segment>:<shard> hashes, 16-byte digest ->
# first-seen second (an offset from the segment's start); nopoll:seen:@head, a hash of
# the live segments ("seq:k:start_s:expire_ms ...", the current one first) and the current
# one's fill. A segment holds the ids of one time bucket (width) in 2^k shards of ~64
# entries (kept as listpacks), sized from the last bucket's rate; one more opens when it is
# full. The fill is counted in steps of 16 for one id in 16 (digest byte 5 picks them).
# '@' is not allowed in provider names: no clash with the nopoll:seen:<p>:<id> keys of
# older versions, still looked up during the first window (since).
# Then, with journeys on, the callback's event on its id's trail (receiver/journey/store.py)
# and, unless a duplicate, the webhook-id's id.
# KEYS: 1 legacy seen key, 2 job key, 3 result key, 4 queue, [5 journey key, 6 hook key].
# ARGV: 1 now ms, 2 window ms, 3 bucket width ms, 4 job expiry ms, 5 digest, 6 job id,
# 7 payload, [8 the event's head, 9 the object id, 10 the journey's ttl ms].
_ENQUEUE_LUA = (
    PUSH_LUA
    + RING_LUA
    + """
local P = 'nopoll:seen:@'
local SPEC = '(%d+):(%d+):(%d+):(%d+)'
local function int(x) return string.format('%d', x) end
local function current(head, h, now, window, width)
  local live, n, cap = h[1] or '', tonumber(h[2] or 0), tonumber(h[3] or 0)
  local bucket, hb = math.floor(now / width), tonumber(h[4] or -1)
  local cur, older = live:match('^([^ ]+) ?(.*)$')
  if cur ~= nil and n < cap and bucket <= hb then return cur, older end
  local bn0, bstart, rate, left = tonumber(h[5] or 0), tonumber(h[6] or 0)
  if cur ~= nil and bucket <= hb then
    bn0, bucket = bn0 + n, hb
    rate, left = bn0 / math.max(now - bstart, 1000), (hb + 1) * width - now
  else
    rate = (bn0 + n) / math.max((hb + 1) * width - bstart, 1000)
    left, bn0, bstart = width, 0, now
  end
  local k = 0
  while k < 24 and 64 * 2 ^ k < rate * left * 1.25 do k = k + 1 end
  local expire = (bucket + 1) * width + window + 1000
  cur = redis.call('HINCRBY', head, 'seq', 1) .. ':' .. k .. ':' .. int(now / 1000) .. ':'
    .. int(expire)
  local keep = {}
  for spec, e in live:gmatch('(%d+:%d+:%d+:(%d+))') do
    if tonumber(e) > now then keep[#keep + 1] = spec end
  end
  older = table.concat(keep, ' ')
  redis.call('HSET', head, 'live', cur .. ' ' .. older, 'n', 0, 'cap', int(64 * 2 ^ k),
    'bucket', int(bucket), 'bn0', int(bn0), 'bstart', int(bstart), 'since', h[7] or int(now))
  redis.call('PEXPIRE', head, int(expire - now))
  return cur, older
end
local function seen(digest, now, window, width, legacy)
  local head = P .. 'head'
  local h = redis.call('HMGET', head, 'live', 'n', 'cap', 'bucket', 'bn0', 'bstart', 'since')
  if (not h[7] or now - h[7] < window) and redis.call('EXISTS', legacy) == 1 then
    return true
  end
  local hv = ((digest:byte(1) * 256 + digest:byte(2)) * 256 + digest:byte(3)) * 256
    + digest:byte(4)
  local cur, older = current(head, h, now, window, width)
  local seq, k, start, expire = cur:match(SPEC)
  local shard, stamp = P .. seq .. ':' .. int(hv % 2 ^ k), math.ceil(now / 1000) - start
  if redis.call('HSETNX', shard, digest, int(stamp)) == 0 then
    if (start + redis.call('HGET', shard, digest)) * 1000 + window > now then return true end
    redis.call('HSET', shard, digest, int(stamp))
  else
    for oseq, ok, ostart, oexpire in older:gmatch(SPEC) do
      if tonumber(oexpire) > now then
        local first = redis.call('HGET', P .. oseq .. ':' .. int(hv % 2 ^ ok), digest)
        if first and (ostart + first) * 1000 + window > now then
          redis.call('HDEL', shard, digest)
          return true
        end
      end
    end
  end
  redis.call('PEXPIRE', shard, int(expire - now))
  if digest:byte(5) % 16 == 0 then redis.call('HINCRBY', head, 'n', 16) end
  return false
end
local now, r = tonumber(ARGV[1]), 1
if seen(ARGV[5], now, tonumber(ARGV[2]), tonumber(ARGV[3]), KEYS[1]) then r = 0
elseif redis.call('EXISTS', KEYS[2], KEYS[3]) > 0 then r = 2
else
  redis.call('SET', KEYS[2], ARGV[7], 'PX', ARGV[4])
  redis.call('ZADD', KEYS[4], ARGV[1], ARGV[6])
  ring(KEYS[4])
end
if KEYS[5] then
  journey_push(KEYS[5], ARGV[8] .. r .. '}', ARGV[10])
  if r ~= 0 then redis.call('SET', KEYS[6], ARGV[9], 'PX', ARGV[10]) end
end
return r
"""
)
_BUCKETS_PER_WINDOW = 7  # 8 lookups; an id's memory is held for the window + <= 1/7 of it


def id_digest(provider: str, webhook_id: str) -> bytes:
    """The 128-bit digest an id is remembered by (64 bits would collide: docs/capacity.md)."""
    return blake2b(f"{provider}\0{webhook_id}".encode(), digest_size=16).digest()


class QueueBusy(Exception):
    """More requests wait for a pipeline than the bound allows: answer 503, retry later."""


class NotReplicated(RedisError):
    """Fewer replicas than ``redis.min_replicas_acked`` confirmed a trip's enqueues in
    time: they are not durable enough to acknowledge (the provider gets 503 and retries)."""


FENCE_KEY = "nopoll:wait:fence"
"""The key every trip that waits for replicas writes last: ``WAIT`` counts only the
writes of its own connection, and a trip whose callbacks were all duplicates wrote
nothing of its own, yet the first copies' writes must be on the replicas too (they come
before the fence in the replication stream)."""


class ReplicaWait:
    """The end of every enqueue trip when ``redis.min_replicas_acked`` is set: a write of
    :data:`FENCE_KEY`, then ``WAIT n timeout`` (or ``WAITAOF 0 n timeout``); fewer replicas
    than ``n`` is :class:`NotReplicated` for every callback of the trip."""

    def __init__(self, replicas: int, timeout_ms: int, *, aof: bool = False) -> None:
        self.replicas, self.timeout_ms, self.aof = replicas, timeout_ms, aof
        self._wait = self._waitaof() if aof else self._plain()

    def _plain(self) -> tuple[Any, ...]:
        return ("WAIT", str(self.replicas), str(self.timeout_ms))

    def _waitaof(self) -> tuple[Any, ...]:
        return ("WAITAOF", "0", str(self.replicas), str(self.timeout_ms))

    def commands(self) -> list[tuple[Any, ...]]:
        return [("INCR", FENCE_KEY), self._wait]

    def check(self, replies: list[Any]) -> None:
        fence, acked = replies
        if isinstance(fence, Exception):
            raise fence
        if isinstance(acked, ResponseError) and self._wait[0] == "WAITAOF":
            if "unknown command" in str(acked).lower():  # before Redis 7.2: WAIT alone
                log.warning("Redis has no WAITAOF: waiting for replicas with WAIT instead")
                self._wait = self._plain()
            raise NotReplicated(f"WAITAOF failed: {acked}")
        if isinstance(acked, Exception):
            raise acked
        count = acked[1] if isinstance(acked, list) else acked
        if int(count) < self.replicas:
            raise NotReplicated(
                f"{count} of the {self.replicas} replicas asked for confirmed the enqueue "
                f"within {self.timeout_ms} ms"
            )


class EnqueueOutcome(IntEnum):
    """What the enqueue script did with one callback."""

    DUPLICATE = 0
    """The webhook-id was seen before: nothing enqueued."""
    ENQUEUED = 1
    """A new job is durably queued."""
    ALREADY_QUEUED = 2
    """A job for the same result is queued or running; this event rides on it."""


_PUT_ONE = (
    PUT_JOB_LUA + "return put_job(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4])"
)


async def put_job(redis: Redis, job: QueuedJob, *, expiry_ms: int) -> bool:
    """Queue ``job`` on its function's queue unless a job with its id exists; True if queued."""
    return bool(await redis.eval(_PUT_ONE, 3, *job.keys(), *job.args(expiry_ms)))  # type: ignore[misc]


class Enqueuer:
    """Durably enqueues callback jobs, coalescing concurrent requests into pipelined round
    trips: up to ``max_in_flight`` at once, each carrying up to ``max_batch`` requests.

    Requests that arrive while every pipeline is in flight wait for the next one to leave;
    at most ``max_pending`` of them (default: one more full batch per pipeline), beyond
    that :meth:`enqueue` raises :class:`QueueBusy` at once. ``clock`` (seconds since the
    epoch) stamps jobs and times the dedupe window; tests move it. ``replicas``: every
    trip ends waiting for that many replicas (:class:`ReplicaWait`).
    """

    def __init__(
        self,
        redis: Redis,
        *,
        dedupe_ttl_s: int,
        job_expiry_s: int,
        max_batch: int = 512,
        max_in_flight: int = 4,
        max_pending: int | None = None,
        journey_ttl_s: int = 0,
        clock: Callable[[], float] = time.time,
        replicas: ReplicaWait | None = None,
    ) -> None:
        self._shared = SharedTrips(
            redis,
            max_batch=max_batch,
            max_in_flight=max_in_flight,
            max_pending=max_pending,
            trailer=replicas,
        )
        self._sha = self._shared.digest(_ENQUEUE_LUA)
        self._window_ms = str(dedupe_ttl_s * 1000)
        self._width_ms = str(max(1, math.ceil(dedupe_ttl_s / _BUCKETS_PER_WINDOW)) * 1000)
        self._job_expiry_ms = str(job_expiry_s * 1000)
        self._journey_ms = str(journey_ttl_s * 1000) if journey_ttl_s > 0 else None
        self._clock = clock
        self._fixed: tuple[int, tuple[str, ...]] = (-1, ())

    @property
    def pending(self) -> int:
        """Requests waiting for a round trip to leave."""
        return self._shared.pending

    async def enqueue(self, job: CallbackJob) -> EnqueueOutcome:
        """Queue one job; returns once Redis has it (or raises a RedisError, or
        :class:`QueueBusy` when too many requests wait already)."""
        now_ms = int(self._clock() * 1000)
        fixed = self._fixed
        if fixed[0] != now_ms:  # the same for every callback of this millisecond
            fixed = self._fixed = (
                now_ms,
                (str(now_ms), self._window_ms, self._width_ms, self._job_expiry_ms),
            )
        try:
            reply = await self._shared.run_one(self._command(job, now_ms, fixed[1]))
        except TripsBusy:
            raise QueueBusy(f"{self._shared.pending} callbacks wait for Redis already") from None
        if isinstance(reply, Exception):
            raise reply
        return EnqueueOutcome(int(reply))

    def _command(self, job: CallbackJob, now_ms: int, fixed: tuple[str, ...]) -> tuple[Any, ...]:
        plain = self._journey_ms is None or not job.object_id
        command = (
            "EVALSHA",
            self._sha,
            "4" if plain else "6",
            f"{SEEN_PREFIX}{job.provider}:{job.webhook_id}",
            JOB_KEY + job.job_id,
            RESULT_KEY + job.job_id,
            job.queue,
        )
        if plain:
            return (
                *command,
                *fixed,
                id_digest(job.provider, job.webhook_id),
                job.job_id,
                job_payload(job.function, job.kwargs, 1, now_ms),
            )
        # job.provider is scoped already: the journey's keys take the plain name + tenant
        provider = job.provider.partition("@")[0]
        return (
            *command,
            journey_key(provider, job.object_id, job.tenant),
            hook_key(provider, job.webhook_id, job.tenant),
            *fixed,
            id_digest(job.provider, job.webhook_id),
            job.job_id,
            job_payload(job.function, job.kwargs, 1, now_ms),
            callback_head(now_ms, job.event_type, job.webhook_id, job.tenant),
            job.object_id,
            self._journey_ms,
        )
