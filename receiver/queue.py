"""The queue between the web app and the worker: arq's job format on Redis.

Callbacks are enqueued by one Lua script that, atomically, remembers the ``webhook-id``
(duplicate deliveries answer 200 and enqueue nothing, also when two copies race), skips
a response that is already queued or running, and writes the job exactly as arq's own
``enqueue_job`` does (``arq:job:<id>`` + a score in the queue's sorted set), so a stock
arq worker runs it. Jobs are JSON, never pickle: nothing read from Redis can run code.

:class:`Enqueuer` coalesces the enqueues of concurrent requests into one pipelined round
trip (group commit): while one round trip is in flight, new requests gather and go in the
next one. One request costs one ``EVALSHA`` in a shared pipeline instead of arq's three
round trips (WATCH, EXISTS, MULTI/EXEC).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from redis import __version__ as redis_version
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from receiver._arq import JOB_KEY, RESULT_KEY, job_payload

try:
    import hiredis

    _hiredis_pack: Any = getattr(hiredis, "pack_command", None)
except ImportError:  # pragma: no cover - arq installs redis[hiredis]
    _hiredis_pack = None

__all__ = [
    "BATCHES_QUEUE",
    "DELIVER",
    "FETCH_BATCH",
    "FETCH_RESPONSE",
    "HEALTH_CHECK_KEY",
    "JOBS_QUEUE",
    "PUT_JOB_LUA",
    "CallbackJob",
    "EnqueueOutcome",
    "Enqueuer",
    "QueuedJob",
    "batch_job_id",
    "put_job",
    "queue_for",
    "redis_client",
    "response_job_id",
]

JOBS_QUEUE = "nopoll:jobs"
"""Short jobs: fetching single responses and re-delivering to sinks."""
HEALTH_CHECK_KEY = JOBS_QUEUE + ":health-check"
"""Written by workers every ``worker.health_check_interval_s`` (arq's health check)."""
BATCHES_QUEUE = "nopoll:batches"
"""Long jobs: streaming a batch's rows (their long timeout must not lock short jobs)."""
SEEN_PREFIX = "nopoll:seen:"

FETCH_RESPONSE = "fetch_response"
"""Job: fetch one finished response and fan it out."""
FETCH_BATCH = "fetch_batch"
"""Job: stream a finished batch's rows into the sinks."""
DELIVER = "deliver"
"""Job: write envelopes to one sink (a retry, a hand-off, a batch summary, a replay)."""
_QUEUE_OF = {FETCH_RESPONSE: JOBS_QUEUE, DELIVER: JOBS_QUEUE, FETCH_BATCH: BATCHES_QUEUE}


def queue_for(function: str) -> str:
    """The queue whose workers run ``function`` (a job on another queue would never run)."""
    try:
        return _QUEUE_OF[function]
    except KeyError:
        raise ValueError(f"unknown job function {function!r}") from None


PUT_JOB_LUA = """
local function put_job(job_key, result_key, queue, payload, expiry_ms, score, job_id)
  if redis.call('EXISTS', job_key, result_key) > 0 then return 0 end
  redis.call('SET', job_key, payload, 'PX', expiry_ms)
  redis.call('ZADD', queue, score, job_id)
  return 1
end
"""
"""A Lua function other scripts include: arq's ``enqueue_job`` (skip when a job or result
with that id exists, else the job key and its score), so a job can be queued in the same
atomic step as the state change that asks for it."""

_ENQUEUE_LUA = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return 0 end
if redis.call('EXISTS', KEYS[2], KEYS[3]) > 0 then return 2 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[5])
return 1
"""


class EnqueueOutcome(IntEnum):
    """What the enqueue script did with one callback."""

    DUPLICATE = 0
    """The webhook-id was seen before: nothing enqueued."""
    ENQUEUED = 1
    """A new job is durably queued."""
    ALREADY_QUEUED = 2
    """A job for the same result is queued or running; this event rides on it."""


@dataclass(frozen=True, slots=True)
class CallbackJob:
    """One verified callback that asks for a fetch."""

    provider: str
    webhook_id: str
    function: str
    job_id: str
    kwargs: dict[str, Any]
    queue: str = JOBS_QUEUE


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """A job to put on its function's queue, in arq's own format
    (:func:`receiver._arq.job_payload`)."""

    function: str
    job_id: str
    kwargs: dict[str, Any]
    defer_s: float = 0.0
    job_try: int | None = None

    @property
    def queue(self) -> str:
        return queue_for(self.function)

    def keys(self) -> list[str]:
        """KEYS for :data:`PUT_JOB_LUA`'s ``put_job``: job key, result key, queue."""
        return [JOB_KEY + self.job_id, RESULT_KEY + self.job_id, self.queue]

    def args(self, expiry_ms: int) -> list[Any]:
        """ARGV for ``put_job``: payload, expiry, score, job id."""
        now_ms = int(time.time() * 1000)
        payload = job_payload(self.function, self.kwargs, self.job_try, now_ms)
        return [payload, expiry_ms, now_ms + int(self.defer_s * 1000), self.job_id]


_PUT_ONE = (
    PUT_JOB_LUA + "return put_job(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4])"
)


async def put_job(redis: Redis, job: QueuedJob, *, expiry_ms: int) -> bool:
    """Queue ``job`` on its function's queue unless a job with its id exists; True if queued."""
    return bool(await redis.eval(_PUT_ONE, 3, *job.keys(), *job.args(expiry_ms)))  # type: ignore[misc]


def response_job_id(provider: str, response_id: str) -> str:
    """The arq job id of a single-response fetch: one pending fetch per response."""
    return f"resp:{provider}:{response_id}"


def batch_job_id(provider: str, batch_id: str) -> str:
    """The arq job id of a batch fetch: one pending fetch per batch."""
    return f"batch:{provider}:{batch_id}"


def redis_client(url: str, *, timeout_s: float = 2.0) -> Redis:
    """A pooled Redis client that fails fast when Redis is down (the app answers 503)."""
    client: Redis = Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=30,
    )
    return client


class Enqueuer:
    """Durably enqueues callback jobs, coalescing concurrent requests into one round trip."""

    def __init__(
        self,
        redis: Redis,
        *,
        dedupe_ttl_s: int,
        job_expiry_s: int,
        max_batch: int = 512,
    ) -> None:
        self._redis = redis
        self._dedupe_ttl_ms = str(dedupe_ttl_s * 1000)
        self._job_expiry_ms = str(job_expiry_s * 1000)
        self._max_batch = max_batch
        self._sha: str | None = None
        self._pending: list[tuple[CallbackJob, asyncio.Future[EnqueueOutcome]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def enqueue(self, job: CallbackJob) -> EnqueueOutcome:
        """Queue one job; returns once Redis has it (or raises a RedisError)."""
        future: asyncio.Future[EnqueueOutcome] = asyncio.get_running_loop().create_future()
        self._pending.append((job, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            try:
                results = await self._run(batch)
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(EnqueueOutcome(int(result)))

    async def _run(self, batch: list[tuple[CallbackJob, Any]], *, reload: bool = True) -> list[Any]:
        if self._sha is None:
            self._sha = await self._redis.script_load(_ENQUEUE_LUA)
        now_ms = int(time.time() * 1000)
        now = str(now_ms)
        commands = []
        for job, _ in batch:
            payload = job_payload(job.function, job.kwargs, 1, now_ms)
            commands.append(
                (
                    "EVALSHA",
                    self._sha,
                    "4",
                    f"{SEEN_PREFIX}{job.provider}:{job.webhook_id}",
                    JOB_KEY + job.job_id,
                    RESULT_KEY + job.job_id,
                    job.queue,
                    self._dedupe_ttl_ms,
                    payload,
                    self._job_expiry_ms,
                    now,
                    job.job_id,
                )
            )
        results = await self._pipeline(commands)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing and reload:
            # Redis restarted and lost its script cache: load it again and redo those.
            self._sha = await self._redis.script_load(_ENQUEUE_LUA)
            redone = await self._run([batch[i] for i in missing], reload=False)
            for i, result in zip(missing, redone, strict=True):
                results[i] = result
        return results

    async def _pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send every command in one write and read the replies: redis-py's pipeline, minus
        its pure-Python command packing (hiredis packs an EVALSHA in ~1 us instead of ~16)."""
        pool = self._redis.connection_pool
        conn = await pool.get_connection(*_GET_CONNECTION_ARGS)
        try:
            packed = [part for c in commands for part in _pack(conn, c)]
            await conn.send_packed_command(packed, check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
        return replies


# redis-py 5.3 deprecated get_connection's command name argument; older ones require it.
_GET_CONNECTION_ARGS: tuple[str, ...] = (
    () if tuple(int(p) for p in redis_version.split(".")[:2]) >= (5, 3) else ("EVALSHA",)
)


def _pack(conn: Any, command: tuple[Any, ...]) -> list[bytes]:
    if _hiredis_pack is not None:
        return [_hiredis_pack(command)]
    return list(conn.pack_command(*command))
