"""arq's Worker, made to keep nopoll's promises: one-round-trip claims, leases, outages.

- Claims: arq claims each polled job with its own optimistic transaction (WATCH, EXISTS,
  ZSCORE, MULTI/PSETEX/EXEC: about four round trips per job). :class:`NopollWorker` claims
  every polled job in one Lua call with the same rule (not in progress, score due) and the
  same in-progress key; its value is a token naming this claim, so a batch job's
  :class:`Lease` can renew the lock only while it is still its own.
- Outages: arq's poll loop ends the process on the first Redis error. Here the loop waits
  for Redis (:class:`~receiver.redis_link.RedisLink`) and carries on; a job whose start or
  finish was cut off by the outage has its lock released once Redis is back, so it runs
  again at once instead of after its lock expires.
- Nothing dropped: whatever arq would fail for good (an expired job, too many tries, an
  unknown function) is kept as a dead letter first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from typing import Any

import orjson
from arq.constants import in_progress_key_prefix
from arq.utils import poll, timestamp_ms
from arq.worker import Function, Worker, func
from redis.asyncio import Redis
from redis.exceptions import RedisError

from nopoll.envelope import now_rfc3339
from receiver.config import Settings
from receiver.deadletter import DeadLetters
from receiver.health import publish_sink_health
from receiver.jobs import letter_target, rules_for
from receiver.metrics import Metrics
from receiver.queue import (
    BATCHES_QUEUE,
    DELIVER,
    FETCH_BATCH,
    FETCH_RESPONSE,
    HEALTH_CHECK_KEY,
    JOBS_QUEUE,
    arq_pool,
    job_deserializer,
    job_serializer,
)
from receiver.redis_link import RedisLink
from receiver.worker import deliver, fetch_batch, fetch_response, shutdown, startup

log = logging.getLogger("nopoll.worker")

_ARQ_SLACK = 5
"""arq's own try limit sits this far above ours, so our code always sees the last try
and keeps it as a dead letter (arq would drop it with only a log line)."""

__all__ = ["Lease", "NopollWorker", "build_workers"]

_CLAIM = """
local claimed = {}
local now = tonumber(ARGV[1])
for i = 4, #ARGV do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[1], id)
  if score and tonumber(score) <= now and redis.call('EXISTS', KEYS[2] .. id) == 0 then
    redis.call('PSETEX', KEYS[2] .. id, ARGV[2], ARGV[3])
    claimed[#claimed + 1] = id
    claimed[#claimed + 1] = score
  end
end
return claimed
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    """A claimed job's in-progress lock, held by the token its claim wrote."""

    def __init__(self, redis: Redis, job_id: str, token: str) -> None:
        self.redis = redis
        self.key = in_progress_key_prefix + job_id
        self.token = token
        self.lost = False
        """Set by whoever finds the lock no longer ours; arq's finish is then skipped."""

    async def renew(self, ttl_ms: int) -> bool:
        """Extend the lock to ``ttl_ms`` from now; False when another claim holds it."""
        return bool(await self.redis.eval(_RENEW, 1, self.key, self.token, str(ttl_ms)))  # type: ignore[misc]

    async def release(self) -> bool:
        """Drop the lock if it is still ours (the job can be claimed again at once)."""
        return bool(await self.redis.eval(_RELEASE, 1, self.key, self.token))  # type: ignore[misc]


class NopollWorker(Worker):
    """An arq Worker with one-call claims, leases, outage riding and no silent failures."""

    def __init__(self, *args: Any, claim_ttl_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._claim_script: Any = None
        self._claim_ttl_s = claim_ttl_s
        self._worker_id = uuid.uuid4().hex[:12]
        self.leases: dict[str, Lease] = {}
        """Running jobs' locks, by job id (``ctx["leases"]``: a batch job renews its own)."""
        self._orphans: set[str] = set()
        self.link = RedisLink(f"worker {self.queue_name}")
        self.last_beat: float | None = None
        """When this process last turned its poll loop (``nopoll worker --health-port``)."""

    async def heart_beat(self) -> None:
        await super().heart_beat()
        self.last_beat = time.monotonic()

    async def record_health(self) -> None:
        before = self._last_health_check
        await super().record_health()
        fanout = self.ctx.get("fanout")
        if self._last_health_check != before and fanout is not None:
            await publish_sink_health(self.pool, fanout, 3 * self.health_check_interval + 5)

    def _alive(self) -> None:
        # Waiting for Redis is this loop's job now: the process is healthy, just idle.
        self.last_beat = time.monotonic()

    async def main(self) -> None:
        """arq's main loop, but a Redis outage pauses it instead of ending the process."""
        self.ctx["redis"] = self.pool
        self.ctx["leases"] = self.leases
        log.info("worker for %s: %s", self.queue_name, ", ".join(self.functions))
        await self.link.wait(self.pool, on_try=self._alive)
        if self.on_startup:
            await self.on_startup(self.ctx)
        async for _ in poll(self.poll_delay_s):
            try:
                await self._poll_iteration()
            except (RedisError, OSError) as exc:
                self.link.lost(exc)
                await self.link.wait(self.pool, on_try=self._alive)
                await self._release_orphans()

    async def run_job(self, job_id: str, score: int) -> None:
        try:
            await super().run_job(job_id, score)
        except (RedisError, OSError) as exc:
            # The job's start or finish could not reach Redis: it is still queued; its
            # lock is released once Redis is back so it runs again at once.
            self.link.lost(exc)
            self._orphans.add(job_id)
        except Exception:
            log.exception("job %s: arq could not run or finish it; it runs again later", job_id)
            self.leases.pop(job_id, None)

    async def _release_orphans(self) -> None:
        for job_id in list(self._orphans):
            lease = self.leases.pop(job_id, None)
            self._orphans.discard(job_id)
            if lease is not None and not lease.lost:
                with contextlib.suppress(RedisError, OSError):
                    await lease.release()

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        free = self.max_jobs - self.job_counter
        if free <= 0 or not job_ids:
            return
        if self._claim_script is None:
            self._claim_script = self.pool.register_script(_CLAIM)
        ids = [j.decode() for j in job_ids[:free]]
        ttl_s = self._claim_ttl_s or self.in_progress_timeout_s
        now = timestamp_ms()
        token = f"{self._worker_id}:{now}"
        claimed = await self._claim_script(
            keys=[self.queue_name, in_progress_key_prefix],
            args=[now, int(ttl_s * 1000), token, *ids],
        )
        for i in range(0, len(claimed), 2):
            job_id = claimed[i].decode()
            score = int(float(claimed[i + 1]))
            self.leases[job_id] = Lease(self.pool, job_id, token)
            await self.sem.acquire()
            self.job_counter += 1
            task = self.loop.create_task(self.run_job(job_id, score))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[job_id] = task

    async def finish_job(self, job_id: str, *args: Any, **kwargs: Any) -> None:
        lease = self.leases.pop(job_id, None)
        if lease is not None and lease.lost:
            return  # another run owns the job now: touch nothing of it
        await super().finish_job(job_id, *args, **kwargs)

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        """arq gives up on a job (expired, too many tries, unknown function, undecodable):
        keep it as a dead letter first."""
        lease = self.leases.pop(job_id, None)
        if lease is not None and lease.lost:
            return
        await self._keep_failed(job_id, result_data)
        await super().finish_failed_job(job_id, result_data)

    async def _keep_failed(self, job_id: str, result_data: bytes | None) -> None:
        result: dict[str, Any] = {}
        if result_data:
            with contextlib.suppress(orjson.JSONDecodeError):
                result = orjson.loads(result_data)
        function = str(result.get("f") or "")
        kwargs = result.get("k") if isinstance(result.get("k"), dict) else {}
        if function not in self.functions or not kwargs:
            function, kwargs = _from_job_id(job_id)
        sink, provider, keys = letter_target(function, kwargs)
        letters = DeadLetters(self.pool)
        letter = await letters.add(
            sink=sink or "fetch",
            provider=provider,
            keys=keys,
            attempts=int(result.get("t") or 0),
            error=f"arq gave up on job {job_id}: {result.get('r') or 'unknown reason'}",
            function=function,
            kwargs=kwargs,
        )
        metrics: Metrics | None = self.ctx.get("metrics")
        if metrics is not None:
            metrics.dead_letters.labels(sink or "fetch").inc()
        log.error("dead letter %s: arq gave up on job %s", letter.id, job_id)

    async def close(self) -> None:
        """arq's close, minus its Redis calls' ability to skip closing the sinks."""
        if not self._handle_signals:
            self.handle_sig(signal.SIGUSR1)
        if not self._pool:
            return
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            await self.pool.delete(self.health_check_key)
        if self.on_shutdown:
            await self.on_shutdown(self.ctx)
        with contextlib.suppress(RedisError, OSError):
            await self.pool.close(close_connection_pool=True)
        self._pool = None


def _from_job_id(job_id: str) -> tuple[str, dict[str, Any]]:
    """What a job was, from its id alone (its payload expired or cannot be read)."""
    kind, _, rest = job_id.partition(":")
    provider, _, object_id = rest.partition(":")
    if kind == "resp" and object_id:
        return FETCH_RESPONSE, {
            "provider": provider,
            "response_id": object_id,
            "event_id": None,
            "received_at": now_rfc3339(),
        }
    if kind == "batch" and object_id:
        return FETCH_BATCH, {
            "provider": provider,
            "batch_id": object_id,
            "event_id": None,
            "received_at": now_rfc3339(),
        }
    # A delivery whose payload is gone cannot be redone; the letter says so and is kept.
    return "", {"job_id": job_id}


def build_workers(
    settings: Settings,
    redis_url: str,
    metrics: Metrics,
    *,
    handle_signals: bool = True,
    extra_ctx: dict[str, Any] | None = None,
) -> list[Worker]:
    """The arq Workers: short jobs on :data:`JOBS_QUEUE`, batches on :data:`BATCHES_QUEUE`."""
    w = settings.worker
    tries = max(settings.fetch_retry.max_tries, settings.sink_retry.max_tries) + _ARQ_SLACK

    def job(coroutine: Any, name: str) -> Function:
        # arq's timeout sits above the job's own deadline: nopoll's always fires first.
        return func(coroutine, name=name, timeout=rules_for(settings, name).arq_timeout_s)

    short = [job(fetch_response, FETCH_RESPONSE), job(deliver, DELIVER)]
    long = [job(fetch_batch, FETCH_BATCH)]
    # One set of sinks and provider clients for the process's workers (see startup).
    extra_ctx = {"shared": {}, **(extra_ctx or {})}
    common: dict[str, Any] = {
        "redis_url": redis_url,
        "metrics": metrics,
        "handle_signals": handle_signals,
        "extra_ctx": extra_ctx,
        "tries": tries,
    }
    return [
        _worker(
            settings,
            short,
            JOBS_QUEUE,
            w.max_jobs,
            rules_for(settings, FETCH_RESPONSE).arq_timeout_s,
            HEALTH_CHECK_KEY,
            # nopoll's deadline ends every job before arq's timeout: the lock needs no more
            claim_ttl_s=rules_for(settings, FETCH_RESPONSE).arq_timeout_s,
            **common,
        ),
        _worker(
            settings,
            long,
            BATCHES_QUEUE,
            settings.batch.max_jobs,
            rules_for(settings, FETCH_BATCH).arq_timeout_s,
            BATCHES_QUEUE + ":health-check",
            # a batch job renews its lock as a lease: a killed worker's batch resumes soon
            claim_ttl_s=settings.batch.lease_s,
            **common,
        ),
    ]


def _worker(
    settings: Settings,
    functions: list[Function],
    queue: str,
    max_jobs: int,
    job_timeout_s: float,
    health_key: str,
    *,
    claim_ttl_s: float | None,
    redis_url: str,
    metrics: Metrics,
    handle_signals: bool,
    extra_ctx: dict[str, Any] | None,
    tries: int,
) -> Worker:
    w = settings.worker
    # Batches arrive a few a day: their queue need not be polled 50 times a second.
    poll_delay = w.poll_delay_s if queue == JOBS_QUEUE else max(w.poll_delay_s, 0.25)
    return NopollWorker(
        functions,
        claim_ttl_s=claim_ttl_s,
        queue_name=queue,
        redis_pool=arq_pool(redis_url, queue=queue, expires_ms=settings.job_expiry_s * 1000),
        on_startup=startup,
        on_shutdown=shutdown,
        ctx={"settings": settings, "metrics": metrics, **(extra_ctx or {})},
        handle_signals=handle_signals,
        job_completion_wait=int(w.shutdown_wait_s),
        max_jobs=max_jobs,
        job_timeout=job_timeout_s,
        keep_result=0,
        poll_delay=poll_delay,
        max_tries=tries,
        health_check_interval=w.health_check_interval_s,
        health_check_key=health_key,
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        expires_extra_ms=settings.job_expiry_s * 1000,
        log_results=False,
    )
