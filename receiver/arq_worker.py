"""arq's Worker with a one-round-trip job claim.

arq claims each job it polled with its own optimistic transaction: WATCH the
in-progress key, EXISTS, ZSCORE, then MULTI/PSETEX/EXEC, about four round trips per job
before it runs. Under a steady stream of callbacks that is most of the worker's Redis
traffic. :class:`NopollWorker` claims every polled job in one Lua script with the same
rule (not already in progress, score due) and the same in-progress key and expiry, then
runs each exactly as arq does (``run_job``), so jobs, retries and results are arq's own.
"""

from __future__ import annotations

import time
from typing import Any

from arq.constants import in_progress_key_prefix
from arq.utils import timestamp_ms
from arq.worker import Function, Worker, func

from receiver.config import Settings
from receiver.metrics import Metrics
from receiver.queue import (
    BATCHES_QUEUE,
    HEALTH_CHECK_KEY,
    JOBS_QUEUE,
    arq_pool,
    job_deserializer,
    job_serializer,
)
from receiver.worker import deliver, fetch_batch, fetch_response, shutdown, startup

_ARQ_SLACK = 5
"""arq's own try limit sits this far above ours, so our code always sees the last try
and keeps it as a dead letter (arq would drop it with only a log line)."""

__all__ = ["NopollWorker", "build_workers"]

_CLAIM = """
local claimed = {}
local now = tonumber(ARGV[1])
for i = 3, #ARGV do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[1], id)
  if score and tonumber(score) <= now and redis.call('EXISTS', KEYS[2] .. id) == 0 then
    redis.call('PSETEX', KEYS[2] .. id, ARGV[2], '1')
    claimed[#claimed + 1] = id
    claimed[#claimed + 1] = score
  end
end
return claimed
"""


class NopollWorker(Worker):
    """An arq Worker whose job claim is one Lua call per poll instead of ~4 round trips per job."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._claim_script: Any = None
        self.last_beat: float | None = None
        """When this process last turned its poll loop (``nopoll worker --health-port``)."""

    async def heart_beat(self) -> None:
        await super().heart_beat()
        self.last_beat = time.monotonic()

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        free = self.max_jobs - self.job_counter
        if free <= 0 or not job_ids:
            return
        if self._claim_script is None:
            self._claim_script = self.pool.register_script(_CLAIM)
        ids = [j.decode() for j in job_ids[:free]]
        timeout_ms = int(self.in_progress_timeout_s * 1000)
        claimed = await self._claim_script(
            keys=[self.queue_name, in_progress_key_prefix],
            args=[timestamp_ms(), timeout_ms, *ids],
        )
        for i in range(0, len(claimed), 2):
            job_id = claimed[i].decode()
            score = int(float(claimed[i + 1]))
            await self.sem.acquire()
            self.job_counter += 1
            task = self.loop.create_task(self.run_job(job_id, score))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[job_id] = task


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
    short: list[Function] = [
        func(
            fetch_response, name="fetch_response", timeout=w.response_job_timeout_s, max_tries=tries
        ),
        func(deliver, name="deliver", timeout=w.response_job_timeout_s, max_tries=tries),
    ]
    long: list[Function] = [
        func(
            fetch_batch, name="fetch_batch", timeout=settings.batch.job_timeout_s, max_tries=tries
        ),
    ]
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
            w.response_job_timeout_s,
            HEALTH_CHECK_KEY,
            **common,
        ),
        _worker(
            settings,
            long,
            BATCHES_QUEUE,
            settings.batch.max_jobs,
            settings.batch.job_timeout_s,
            BATCHES_QUEUE + ":health-check",
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
