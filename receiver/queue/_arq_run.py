"""Running a job the seam claimed, as arq's ``Worker.run_job`` would, and finishing it.

Part of the arq seam (:mod:`receiver.queue._arq`, which checks the arq version these internals
fit). :class:`JobRunner` takes a job the claim already read (payload and try count) and
applies arq's rules step for step: an expired or unreadable job, an unknown function and
too many tries go to ``finish_failed_job``; the function runs under arq's timeout; a
``Retry`` is deferred, a cancellation runs the job again, any other exception fails it.
What arq writes at the end is written too, except that the jobs finishing while one
finish is in flight share the next Lua call (arq: a MULTI/EXEC per job).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, retry_key_prefix
from arq.jobs import SerializationError, deserialize_job_raw, serialize_result
from arq.utils import ms_to_datetime, timestamp_ms
from arq.worker import Function, JobExecutionFailed, Retry, RetryJob, Worker, no_result

from sinks.coalesce import GroupCommit

__all__ = ["Claimed", "GivenUp", "JobRunner", "given_up"]

_arq_log = logging.getLogger("arq.worker")
"""Where the lines arq's own ``run_job`` logs go (quiet below debug: see receiver.logs)."""

_RETRY_KEY_TTL_S = 88400  # how long arq keeps a job's try counter
_Finish = tuple[str, bool, int]
"""A job that ended: its id, whether it is done for good, the ms a retry is deferred."""

_FINISH = """
for i = 4, #ARGV, 3 do
  local id = ARGV[i]
  if ARGV[i + 1] == '1' then
    redis.call('DEL', ARGV[1] .. id, ARGV[2] .. id, ARGV[3] .. id)
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('DEL', ARGV[1] .. id)
    if ARGV[i + 2] ~= '0' then redis.call('ZINCRBY', KEYS[1], ARGV[i + 2], id) end
  end
end
return 0
"""


@dataclass(slots=True)
class Claimed:
    """A job as the claim read it, and what its payload says once decoded."""

    id: str
    score: int
    payload: bytes | None
    job_try: int
    function: str = "<unknown>"
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    enqueue_ms: int = 0
    start_ms: int = 0

    @property
    def ref(self) -> str:
        return f"{self.id}:{self.function}"


@dataclass(slots=True)
class _Outcome:
    """How a job's run ended, in arq's terms."""

    finish: bool = False
    """Done for good (success or failure): its keys go; else it stays queued."""
    result: Any = no_result
    success: bool = False
    incr_score: int | None = None
    """A retry's delay: the queue score moves this far (ms)."""
    finished_ms: int = 0


@dataclass(frozen=True, slots=True)
class GivenUp:
    """A job arq's rules drop for good (expired, too many tries, unknown function, unreadable)."""

    job_id: str
    function: str | None
    """None when the job's payload is gone or names no function of this worker."""
    kwargs: dict[str, Any] | None
    tries: int
    reason: str


class JobRunner(Worker):
    """An arq Worker whose jobs arrive claimed (:class:`Claimed`): :meth:`run_claimed` runs
    one; jobs finishing together share one Lua call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("cron_jobs"):
            raise ValueError("nopoll's worker runs no cron jobs")
        super().__init__(*args, **kwargs)
        self._finish_script: Any = None
        self._finishes = GroupCommit(self._finish_group)

    async def run_claimed(self, job: Claimed) -> None:
        """arq's ``Worker.run_job`` for a claimed job: the same checks, hooks, outcomes and
        Redis writes, with the payload and try count the claim already read."""
        job.start_ms = timestamp_ms()
        function = await self._function_for(job)
        if function is None:
            return
        ctx = {
            **self.ctx,
            "job_id": job.id,
            "job_try": job.job_try,
            "enqueue_time": ms_to_datetime(job.enqueue_ms),
            "score": job.score,
        }
        if self.on_job_start:
            await self.on_job_start(ctx)
        timeout_s = self.job_timeout_s if function.timeout_s is None else function.timeout_s
        outcome = await self._call(function, job, ctx, timeout_s)
        forever = (
            self.keep_result_forever
            if function.keep_result_forever is None
            else function.keep_result_forever
        )
        keep_s = self.keep_result_s if function.keep_result_s is None else function.keep_result_s
        result_data = None
        if outcome.result is not no_result and (forever or keep_s > 0):
            result_data = self._result(job, outcome.success, outcome.result, outcome.finished_ms)
        if self.on_job_end:
            await self.on_job_end(ctx)
        finish = self.finish_job(
            job.id, outcome.finish, result_data, keep_s, forever, outcome.incr_score, None
        )
        await asyncio.shield(finish)
        if self.after_job_end:
            await self.after_job_end(ctx)

    async def _function_for(self, job: Claimed) -> Function | None:
        """The job's function, after arq's checks; None when the job failed one of them."""
        if job.payload is None:
            _arq_log.warning("job %s expired", job.id)
            await self._job_failed(job, JobExecutionFailed("job expired"))
            return None
        try:
            job.function, job.args, job.kwargs, enqueued_try, job.enqueue_ms = deserialize_job_raw(
                job.payload, deserializer=self.job_deserializer
            )
        except SerializationError as exc:
            _arq_log.exception("deserializing job %s failed", job.id)
            await self._job_failed(job, exc)
            return None
        function = self.functions.get(job.function)
        if not isinstance(function, Function):
            _arq_log.warning("job %s, function %r not found", job.id, job.function)
            failure = JobExecutionFailed(f"function {job.function!r} not found")
            await self._job_failed(job, failure)
            return None
        if enqueued_try and enqueued_try > job.job_try:
            job.job_try = enqueued_try
            await self.pool.setex(retry_key_prefix + job.id, _RETRY_KEY_TTL_S, str(job.job_try))
        max_tries = self.max_tries if function.max_tries is None else function.max_tries
        if job.job_try > max_tries:
            _arq_log.warning("%s max retries %d exceeded", job.ref, max_tries)
            failure = JobExecutionFailed(f"max {max_tries} retries exceeded")
            await self._job_failed(job, failure)
            return None
        return function

    async def _call(
        self, function: Function, job: Claimed, ctx: dict[str, Any], timeout_s: float | None
    ) -> _Outcome:
        """Run the job under arq's timeout; the outcome arq's rules give what it raised."""
        outcome = _Outcome()
        task = asyncio.current_task()
        if task is not None:
            self.job_tasks[job.id] = task  # what an abort cancels
        try:
            async with asyncio.timeout(timeout_s):
                outcome.result = await function.coroutine(ctx, *job.args, **job.kwargs)
        except (Exception, asyncio.CancelledError) as exc:
            outcome.finished_ms = timestamp_ms()
            self._judge(job, exc, outcome)
        else:
            outcome.finished_ms = timestamp_ms()
            outcome.finish = outcome.success = True
            self.jobs_complete += 1
        finally:
            self.job_tasks.pop(job.id, None)
        return outcome

    def _judge(self, job: Claimed, exc: BaseException, outcome: _Outcome) -> None:
        """arq's rules for a job that raised: retry (deferred or not), aborted, or failed."""
        if self.retry_jobs and isinstance(exc, Retry):
            outcome.incr_score = exc.defer_score
            if exc.defer_score:
                outcome.incr_score = exc.defer_score + (timestamp_ms() - job.score)
            self.jobs_retried += 1
        elif job.id in self.aborting_tasks and isinstance(exc, asyncio.CancelledError):
            outcome.result, outcome.finish = exc, True
            self.aborting_tasks.remove(job.id)
            self.jobs_failed += 1
        elif self.retry_jobs and isinstance(exc, asyncio.CancelledError | RetryJob):
            _arq_log.info("%s cancelled, will be run again", job.ref)
            self.jobs_retried += 1
        else:
            _arq_log.error("%s failed, %s: %s", job.ref, type(exc).__name__, exc, exc_info=exc)
            outcome.result, outcome.finish = exc, True
            self.jobs_failed += 1

    def _result(self, job: Claimed, success: bool, result: Any, finished_ms: int) -> bytes | None:
        return serialize_result(
            job.function,
            job.args,
            job.kwargs,
            job.job_try,
            job.enqueue_ms,
            success,
            result,
            job.start_ms,
            finished_ms,
            job.ref,
            self.queue_name,
            job_id=job.id,
            serializer=self.job_serializer,
        )

    async def _job_failed(self, job: Claimed, exc: BaseException) -> None:
        """arq's end of a job it cannot run: counted failed, then :meth:`finish_failed_job`."""
        self.jobs_failed += 1
        data = self._result(job, False, exc, timestamp_ms())
        await asyncio.shield(self.finish_failed_job(job.id, data))

    async def finish_job(
        self,
        job_id: str,
        finish: bool,
        result_data: bytes | None,
        result_timeout_s: float | None,
        keep_result_forever: bool,
        incr_score: int | None,
        keep_in_progress: float | None,
    ) -> None:
        """arq's finish: the job's keys go (``finish``) or its lock does (a retry, deferred by
        ``incr_score`` ms). Jobs finishing together share one Lua call."""
        if not self.owns(job_id):
            return
        if result_data is not None or keep_in_progress is not None:
            await super().finish_job(
                job_id,
                finish,
                result_data,
                result_timeout_s,
                keep_result_forever,
                incr_score,
                keep_in_progress,
            )
            return
        await self._finishes.submit((job_id, finish, incr_score or 0))

    def owns(self, job_id: str) -> bool:
        """Hook: whether this run may still write the job's keys when it ends."""
        return True

    async def _finish_group(self, group: list[tuple[_Finish, asyncio.Future[None]]]) -> None:
        """One Lua call for every job in ``group`` (see :data:`_FINISH`)."""
        if self._finish_script is None:
            self._finish_script = self.pool.register_script(_FINISH)
        args: list[Any] = [in_progress_key_prefix, retry_key_prefix, job_key_prefix]
        for (job_id, finish, incr_score), _ in group:
            args += [job_id, int(finish), incr_score]
        await self._finish_script(keys=[self.queue_name, abort_jobs_ss], args=args)


def given_up(job_id: str, result_data: bytes | None, functions: Mapping[str, Any]) -> GivenUp:
    """What arq's result record of a job it gives up on says about it."""
    result: dict[str, Any] = {}
    if result_data:
        with contextlib.suppress(orjson.JSONDecodeError):
            result = orjson.loads(result_data)
    function = str(result.get("f") or "")
    kwargs = result.get("k") if isinstance(result.get("k"), dict) else {}
    known = function in functions and bool(kwargs)
    reason = f"arq gave up on job {job_id}: {result.get('r') or 'unknown reason'}"
    return GivenUp(
        job_id,
        function if known else None,
        kwargs if known else None,
        int(result.get("t") or 0),
        reason,
    )
