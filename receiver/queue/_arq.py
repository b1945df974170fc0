"""The one place nopoll touches arq's internals; everything else goes through here.

nopoll depends on arq's job format and key names, ``serialize_job`` and
``deserialize_job_raw``, and the :class:`arq.worker.Worker` methods that
:class:`SeamWorker` overrides; the installed arq and redis-py are checked against
:data:`SUPPORTED` before any of those is imported. :class:`SeamWorker` claims due jobs in
one Lua call with a token naming the claim (:class:`Lease` renews it), runs them by arq's
rules (:class:`JobRunner`), batches the finishes, waits out Redis outages, and hands
whatever arq would fail for good to :meth:`SeamWorker.give_up` first.

See docs/architecture.md (the seam over arq).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import arq
import orjson
import redis as redis_py

from receiver.aio import settle_cancelled, where
from receiver.redis.connector import RedisConnector
from receiver.redis.link import RedisLink
from sinks.coalesce import GroupCommit

__all__ = [
    "IN_PROGRESS_KEY",
    "JOB_KEY",
    "RESULT_KEY",
    "RETRY_KEY",
    "RING_LUA",
    "SUPPORTED",
    "WAKE_KEY",
    "Claimed",
    "Function",
    "GivenUp",
    "JobRunner",
    "Lease",
    "Retry",
    "SeamWorker",
    "arq_pool",
    "func",
    "given_up",
    "job_deserializer",
    "job_payload",
    "job_serializer",
    "stop_workers",
    "wait_stopped",
]

log = logging.getLogger("nopoll.worker")

SUPPORTED = {"arq": ((0, 26), (0, 29)), "redis": ((5, 0), (6, 0))}
"""[lowest, first unsupported) version of each library nopoll's use of internals fits."""


def _version(text: str) -> tuple[int, int]:
    major, minor, *_ = (int("".join(c for c in p if c.isdigit()) or 0) for p in text.split("."))
    return major, minor


def _check_versions() -> None:
    found = {"arq": arq.VERSION, "redis": redis_py.__version__}
    for name, (low, high) in SUPPORTED.items():
        if not low <= _version(found[name]) < high:
            raise ImportError(
                f"nopoll works with {name} >={low[0]}.{low[1]},<{high[0]}.{high[1]}; "
                f"{found[name]} is installed (pip install 'nopoll' pulls a fitting one)"
            )


_check_versions()

# arq's and redis-py's internals, imported only once their versions are known to fit
from arq import Retry  # noqa: E402
from arq.connections import ArqRedis  # noqa: E402
from arq.constants import (  # noqa: E402
    abort_jobs_ss,
    in_progress_key_prefix,
    job_key_prefix,
    result_key_prefix,
    retry_key_prefix,
)
from arq.jobs import (  # noqa: E402
    SerializationError,
    deserialize_job_raw,
    serialize_job,
    serialize_result,
)
from arq.utils import ms_to_datetime, timestamp_ms  # noqa: E402
from arq.worker import (  # noqa: E402
    Function,
    JobExecutionFailed,
    RetryJob,
    Worker,
    func,
    no_result,
)
from redis.asyncio import Redis  # noqa: E402
from redis.asyncio.connection import AbstractConnection  # noqa: E402
from redis.exceptions import NoScriptError, RedisError, ResponseError  # noqa: E402

from receiver.queue.trips import UNBOUNDED, SharedTrips  # noqa: E402
from receiver.redis.wire import read_replies, send_commands, take_connection  # noqa: E402

JOB_KEY = job_key_prefix
"""``arq:job:<id>``: a queued job's payload."""
RESULT_KEY = result_key_prefix
"""``arq:result:<id>``: a finished job's result (nopoll keeps none)."""
IN_PROGRESS_KEY = in_progress_key_prefix
"""``arq:in-progress:<id>``: the lock of a running job."""
RETRY_KEY = retry_key_prefix
"""``arq:retry:<id>``: how many times a job has been tried."""
WAKE_KEY = "nopoll:wake:"
"""``nopoll:wake:<queue>``: the queue's bell, a list of at most one entry. Whatever puts a
job on the queue rings it (pushes one entry when it is empty); an idle worker waits on it
with ``BLPOP`` (:meth:`SeamWorker.wait_for_work`), so a new job is claimed at once rather
than at the next poll, and one ring wakes one worker."""

RING_LUA = (
    """
local function ring(queue)
  local bell = '"""
    + WAKE_KEY
    + """' .. queue
  if redis.call('LLEN', bell) == 0 then redis.call('RPUSH', bell, '1') end
end
"""
)
"""A Lua function scripts that queue a job include: ``ring(queue)`` rings the queue's bell
(:data:`WAKE_KEY`)."""


def job_serializer(obj: Any) -> bytes:
    """arq job serializer: JSON (orjson), never pickle."""
    return orjson.dumps(obj, default=str)


def job_deserializer(data: bytes) -> Any:
    """arq job deserializer: JSON only."""
    return orjson.loads(data)


def job_payload(function: str, kwargs: dict[str, Any], job_try: int | None, at_ms: int) -> bytes:
    """A job exactly as ``ArqRedis.enqueue_job`` writes it (arq's own ``serialize_job``)."""
    return serialize_job(function, (), kwargs, job_try, at_ms, serializer=job_serializer)


def arq_pool(
    redis: RedisConnector, *, queue: str | None = None, expires_ms: int | None = None
) -> ArqRedis:
    """An arq Redis pool of the ``queue`` role that speaks JSON jobs (``queue``: where
    ``enqueue_job`` puts them)."""
    kwargs: dict[str, Any] = {}
    if expires_ms is not None:
        kwargs["expires_extra_ms"] = expires_ms
    if queue is not None:
        kwargs["default_queue_name"] = queue
    pool = ArqRedis(
        connection_pool=redis.pool("queue"),
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        **kwargs,
    )
    pool.auto_close_connection_pool = True  # aclose() also closes the pool we made
    return pool


_arq_log = logging.getLogger("arq.worker")
"""Where the lines arq's own ``run_job`` logs go (quiet below debug: see receiver.logs)."""

_RETRY_KEY_TTL_S = 88400  # how long arq keeps a job's try counter
_Finish = tuple[str, bool, int]
"""A job that ended: its id, whether it is done for good, the ms a retry is deferred."""

_FINISH = (
    RING_LUA
    + """
local again = false
for i = 4, #ARGV, 3 do
  local id = ARGV[i]
  if ARGV[i + 1] == '1' then
    redis.call('DEL', ARGV[1] .. id, ARGV[2] .. id, ARGV[3] .. id)
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('DEL', ARGV[1] .. id)
    if ARGV[i + 2] ~= '0' then redis.call('ZADD', KEYS[1], 'XX', 'INCR', ARGV[i + 2], id) end
    again = true
  end
end
if again then ring(KEYS[1]) end
return 0
"""
)
"""Jobs that ended, in one call: gone, or retried (due again, now or later: the bell rings
so an idle worker looks again and learns when it is due). A retry never puts back a job
that is gone (``XX``: its own last trip may have ended it, :meth:`JobRunner.end_command`)."""


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
        self._trips: SharedTrips | None = None
        self._finishes = GroupCommit(self._finish_group)
        self._ended: set[str] = set()
        """Jobs whose own last trip carried their finish (:meth:`end_command`)."""

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
            "end_command": lambda trips: self.end_command(job.id, trips),
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
        if job.id in self._ended:  # its own last trip ended it
            self._ended.discard(job.id)
            if outcome.finish and outcome.success:
                self.owns(job.id)  # its lease is let go
            else:  # it failed after that trip: a retry puts back nothing that went
                await asyncio.shield(self._finish_soon(job.id, False, outcome.incr_score))
        elif result_data is None:  # the common end: its keys go in the next grouped call
            await asyncio.shield(self._finish_soon(job.id, outcome.finish, outcome.incr_score))
        else:
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
        await self._finishes.put((job_id, finish, incr_score or 0))

    def end_command(self, job_id: str, trips: SharedTrips) -> tuple[Any, ...] | None:
        """The command that ends the running job ``job_id`` for good (as a success does),
        for the job to send in its own last round trip with its other writes (``ctx
        ["end_command"]``): one trip fewer per job. None when this run no longer owns it.
        Once sent, the job is never put back as unfinished (its keys may be gone)."""
        lease = getattr(self, "leases", {}).get(job_id)
        if lease is not None and lease.lost:
            return None
        self._ended.add(job_id)
        args = [in_progress_key_prefix, retry_key_prefix, job_key_prefix, job_id, 1, 0]
        return trips.evalsha(_FINISH, 2, self.queue_name, abort_jobs_ss, *args)

    def _finish_soon(
        self, job_id: str, finish: bool, incr_score: int | None
    ) -> asyncio.Future[None]:
        """:meth:`finish_job` without a result to keep, handed in at once: the future of
        the grouped call its keys go in (done at once when this run no longer owns them)."""
        if not self.owns(job_id):
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return self._finishes.put((job_id, finish, incr_score or 0))

    def owns(self, job_id: str) -> bool:
        """Hook: whether this run may still write the job's keys when it ends."""
        return True

    async def _finish_group(self, group: list[tuple[_Finish, asyncio.Future[None]]]) -> None:
        """One Lua call for every job in ``group`` (see :data:`_FINISH`)."""
        args: list[Any] = [in_progress_key_prefix, retry_key_prefix, job_key_prefix]
        for (job_id, finish, incr_score), _ in group:
            args += [job_id, int(finish), incr_score]
        await self.script(_FINISH, [self.queue_name, abort_jobs_ss], args)

    def _shared_trips(self) -> SharedTrips:
        if self._trips is None:
            # one trip out at a time: claims and finishes asked meanwhile share the next
            self._trips = SharedTrips(self.pool, max_in_flight=1, max_pending=UNBOUNDED)
        return self._trips

    async def script(self, source: str, keys: list[str], args: list[Any]) -> Any:
        """Run the Lua ``source`` in a round trip shared with the worker's other claims and
        finishes (:class:`~receiver.queue.trips.SharedTrips`); its reply, or its error
        raised."""
        trips = self._shared_trips()
        [reply] = await trips.run([trips.evalsha(source, len(keys), *keys, *args)])
        if isinstance(reply, Exception):
            raise reply
        return reply


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


_CLAIM = """
local now = tonumber(ARGV[1])
local want = tonumber(ARGV[4])
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, ARGV[5])
local claimed = {}
for i = 1, #due, 2 do
  if #claimed >= 4 * want then break end
  local id = due[i]
  if redis.call('EXISTS', ARGV[6] .. id) == 0 then
    redis.call('PSETEX', ARGV[6] .. id, ARGV[2], ARGV[3])
    if ARGV[9] ~= '' then redis.call('SADD', ARGV[9], ARGV[6] .. id) end
    local tries = redis.call('INCR', ARGV[8] .. id)
    redis.call('EXPIRE', ARGV[8] .. id, 88400)
    claimed[#claimed + 1] = id
    claimed[#claimed + 1] = due[i + 1]
    claimed[#claimed + 1] = redis.call('GET', ARGV[7] .. id)
    claimed[#claimed + 1] = tries
  end
end
if #claimed < 4 * want and #due < 2 * tonumber(ARGV[5]) then
  local later = redis.call(
    'ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  claimed[#claimed + 1] = later[2] or ''
end
return claimed
"""
"""Claim up to ``want`` due jobs that no one holds: for each its id, score, payload and
try. When fewer were found and every due job was read, one more entry: the score of the
next job due later ('' if none), which an idle worker waits for at most."""
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


class SeamWorker(JobRunner):
    """An arq Worker with one-call claims, grouped finishes, leases, outage riding, and
    hooks where nopoll's policy comes in (:meth:`give_up`, :meth:`health_checked`)."""

    def __init__(
        self,
        *args: Any,
        claim_ttl_s: float | None = None,
        idle_wait_s: float | None = None,
        worker_id: str | None = None,
        held_key: str = "",
        stop_at_once: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._claim_ttl_s = claim_ttl_s
        self._idle_wait_s = idle_wait_s
        """An idle worker waits on its queue's bell this long at most (None: no bell, it
        polls every ``poll_delay_s`` as arq does)."""
        self._bell = WAKE_KEY + self.queue_name
        self._bell_conn: AbstractConnection | None = None
        """The worker's own connection to the bell: each claim leaves on it with the
        ``BLPOP`` after it, in one write (:meth:`_claim_then_wait`)."""
        self._ring: asyncio.Task[Any] | None = None
        """The read of that ``BLPOP``'s reply while it is out (None: no wait is out)."""
        self._idle_for: float | None = None
        """Set by each poll turn: how long the worker may now wait idle (None: it is full)."""
        self._worker_id = worker_id or uuid.uuid4().hex[:12]
        """The start of every claim's token: the process's id when its liveness is kept."""
        self._held_key = held_key
        """Where each claim's lock key is added ('': nowhere): :mod:`receiver.worker.liveness`."""
        self.stop_at_once = stop_at_once
        """On stop, cancel running jobs at once rather than let them finish (batch jobs:
        they resume after their last committed chunk, on another worker)."""
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
        if self._last_health_check != before:
            await self.health_checked()

    async def health_checked(self) -> None:
        """Hook: the worker just wrote its heartbeat (every ``health_check_interval``)."""

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
        try:
            while True:
                try:
                    await self._poll_iteration()
                    if self.burst and await self._burst_done():
                        return
                    await self.wait_for_work(self._idle_for)
                except (RedisError, OSError) as exc:
                    self.link.lost(exc)
                    await self._drop_bell()
                    await self.link.wait(self.pool, on_try=self._alive)
                    await self._release_orphans()
        finally:
            if self._ring is not None:  # its connection is closed with the pool (close)
                self._ring.cancel()

    async def _burst_done(self) -> bool:
        """arq's burst rule: stop once ``max_burst_jobs`` ran or the queue is empty."""
        if 0 <= self.max_burst_jobs <= self._jobs_started() or not await self.pool.zcard(
            self.queue_name
        ):
            await asyncio.gather(*self.tasks.values())
            return True
        return False

    async def _poll_iteration(self) -> None:
        """arq's poll turn, with the due jobs read and claimed in :meth:`_claim`; it sets
        how long the worker may wait idle now (None: it is full, it looks again soon)."""
        free = self._free()
        idle_for = None
        if self.allow_pick_jobs and free > 0:
            idle_for = await self._claim(free)
        if self.allow_abort_jobs:
            await self._cancel_aborted_jobs()
        for job_id, task in list(self.tasks.items()):
            if task.done():
                del self.tasks[job_id]
                task.result()
        await self.heart_beat()
        self._idle_for = idle_for

    def _free(self) -> int:
        """How many more jobs this worker may start now."""
        free = self.max_jobs - self.job_counter
        if self.burst and self.max_burst_jobs >= 0:
            free = min(free, self.max_burst_jobs - self._jobs_started())
        return free

    async def wait_for_work(self, idle_for: float | None) -> None:
        """Until the next look at the queue. An idle worker (its last claim found fewer
        jobs than it had room for) waits on the queue's bell (:data:`WAKE_KEY`) until a job
        is queued, the next deferred job is due, or ``idle_wait_s`` passed; a full one
        polls every ``poll_delay_s``, as do all without a bell. A ring that reaches a
        worker with no room for its job is passed on to the others."""
        if idle_for is None or self._idle_wait_s is None:
            if self._ring is None:
                await asyncio.sleep(self.poll_delay_s)
                return
            # a wait went out with the claim that filled this worker: a ring it brings
            # is for a job this worker has no room for now, so it goes to the others
            await asyncio.wait({self._ring}, timeout=self.poll_delay_s)
            rung = self._ring.done() and self._rung()
            if rung and (not self.allow_pick_jobs or self._free() <= 0):
                await self.script(RING_LUA + "ring(KEYS[1])", [self.queue_name], [])
            return
        timeout = round(min(idle_for, self._idle_wait_s), 3)
        if timeout <= 0:
            return
        if self._ring is None:  # no wait went out with the last claim
            await self._claim_then_wait(None)
        ring = self._ring
        assert ring is not None
        # the BLPOP's own timeout (idle_wait_s, from when it went out) ends it in time
        await asyncio.wait({ring}, timeout=None if timeout >= self._idle_wait_s else timeout)
        if ring.done():
            self._rung()

    def _rung(self) -> bool:
        """The ``BLPOP`` that was out came back: whether it brought a ring (its error
        raised: the bell's connection broke)."""
        ring, self._ring = self._ring, None
        assert ring is not None and ring.done()
        return ring.result() is not None

    async def _claim_then_wait(self, claim: tuple[Any, ...] | None) -> Any:
        """Send ``claim`` (None: nothing) and a ``BLPOP`` of the bell in one write on the
        bell's own connection: one round trip where a claim and then a wait took two. The
        claim runs in Redis as it arrives, from a worker that is running; the wait is what
        a worker that froze after it leaves behind, and it swallows one ring at most (the
        others poll within ``idle_wait_s``). Returns the claim's reply (an error reply in its
        place); :attr:`_ring` reads the ``BLPOP``'s."""
        assert self._idle_wait_s is not None and self._ring is None
        commands = [("BLPOP", self._bell, self._idle_wait_s)]
        if claim is not None:
            commands.insert(0, claim)
        conn = self._bell_conn
        if conn is None:
            conn = self._bell_conn = await take_connection(self.pool.connection_pool)
        try:
            await send_commands(conn, commands)
            replies = await read_replies(conn, 1) if claim is not None else [None]
        except BaseException:
            await self._drop_bell()
            raise
        within_s = self._idle_wait_s + (conn.socket_timeout or 5.0)
        self._ring = asyncio.create_task(self._read_ring(conn, within_s))
        return replies[0]

    @staticmethod
    async def _read_ring(conn: AbstractConnection, within_s: float) -> Any:
        """The ``BLPOP``'s reply; a failed read raises, and the poll loop then closes the
        connection (:meth:`_drop_bell`)."""
        [reply] = await read_replies(conn, 1, within_s=within_s)
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def _drop_bell(self) -> None:
        """Close the bell's connection (a trip or a wait on it failed, Redis was lost, or
        the worker closes); the next wait opens another."""
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await ring
        conn, self._bell_conn = self._bell_conn, None
        if conn is not None:
            with contextlib.suppress(RedisError, OSError):
                await conn.disconnect()
            await self.pool.connection_pool.release(conn)

    async def _claim(self, free: int) -> float | None:
        """One Lua call claims up to ``free`` due jobs (not in progress) and does what arq's
        ``run_job`` does first for each: count the try and read the payload. None when it
        found ``free``; else the seconds until the next job due later (inf: none)."""
        now = timestamp_ms()
        token = f"{self._worker_id}:{now}"
        ttl_ms = int((self._claim_ttl_s or self.in_progress_timeout_s) * 1000)
        prefixes = (in_progress_key_prefix, job_key_prefix, retry_key_prefix)
        args = [now, ttl_ms, token, free, self.queue_read_limit, *prefixes, self._held_key]
        if self._idle_wait_s is None or self._ring is not None or self._idle_for is None:
            # no bell, a wait is out already, or the last claim filled this worker (a
            # busy one looks again after poll_delay_s, with no wait out meanwhile)
            reply = await self.script(_CLAIM, [self.queue_name], args)
        else:  # it was idle: the claim and the wait on the bell after it, in one trip
            trips = self._shared_trips()
            reply = await self._claim_then_wait(trips.evalsha(_CLAIM, 1, self.queue_name, *args))
            if isinstance(reply, NoScriptError):  # Redis lost its scripts: loaded again
                reply = await self.script(_CLAIM, [self.queue_name], args)
            elif isinstance(reply, ResponseError):
                raise reply
        idle_for = None
        if len(reply) % 4:  # fewer than free: when the next deferred job is due
            later = reply.pop()
            idle_for = (float(later) - now) / 1000 if later else math.inf
        for i in range(0, len(reply), 4):
            job = Claimed(reply[i].decode(), int(float(reply[i + 1])), reply[i + 2], reply[i + 3])
            lease = self.leases[job.id] = Lease(self.pool, job.id, token)
            await self.sem.acquire()
            if self.leases.get(job.id) is not lease:  # handed back meanwhile (hand_back)
                self.sem.release()
                continue
            self.job_counter += 1
            task = self.loop.create_task(self._run_claimed(job))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[job.id] = task
        return idle_for

    async def _run_claimed(self, job: Claimed) -> None:
        try:
            await self.run_claimed(job)
        except (RedisError, OSError) as exc:
            # The job's start or finish could not reach Redis: it is still queued; its
            # lock is released once Redis is back so it runs again at once.
            self.link.lost(exc)
            self._orphans.add(job.id)
        except Exception:
            log.exception("job %s: arq could not run or finish it; it runs again later", job.id)
            self.leases.pop(job.id, None)

    async def _release_orphans(self) -> None:
        for job_id in list(self._orphans):
            lease = self.leases.pop(job_id, None)
            self._orphans.discard(job_id)
            if lease is not None and not lease.lost:
                with contextlib.suppress(RedisError, OSError):
                    await lease.release()

    async def hand_back(self) -> int:
        """Stopping: release the lock of every job claimed but not started yet (it runs on
        another worker at once); how many."""
        unstarted = [i for i in self.leases if i not in self.tasks]
        released = 0
        for job_id in unstarted:
            lease = self.leases.pop(job_id)
            with contextlib.suppress(RedisError, OSError):
                released += await lease.release()
        return released

    def owns(self, job_id: str) -> bool:
        """False when the job's lease was lost: another run owns the job now, so this one
        touches nothing of it. Its lease is let go either way."""
        lease = self.leases.pop(job_id, None)
        return lease is None or not lease.lost

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        """arq gives up on a job (expired, too many tries, unknown function, undecodable):
        keep it as a dead letter first."""
        if not self.owns(job_id):
            return
        await self.give_up(given_up(job_id, result_data, self.functions))
        await super().finish_failed_job(job_id, result_data)

    async def give_up(self, job: GivenUp) -> None:
        """Hook: arq is about to drop a job for good. Raise to keep it queued (a Redis
        error does)."""
        raise NotImplementedError

    async def close(self) -> None:
        """arq's close, minus its Redis calls' ability to skip closing the sinks."""
        if not self._handle_signals:
            self.handle_sig(signal.SIGUSR1)
        if not self._pool:
            return
        await settle_cancelled(list(self.tasks.values()), _CLOSE_WAIT_S)
        await self._drop_bell()
        with contextlib.suppress(RedisError, OSError):
            await self.pool.delete(self.health_check_key)
        if self.on_shutdown:
            await self.on_shutdown(self.ctx)
        with contextlib.suppress(RedisError, OSError):
            await self.pool.close(close_connection_pool=True)
        self._pool = None


_CLOSE_WAIT_S = 30.0
"""How long :meth:`SeamWorker.close` waits for its cancelled jobs before it goes on."""


def stop_workers(workers: Sequence[SeamWorker], *, wait: bool) -> None:
    """Stop taking jobs; with ``wait`` let running ones finish for the workers'
    ``job_completion_wait`` first (except a ``stop_at_once`` worker's), else cancel them
    (arq runs a cancelled job again)."""
    for worker in workers:
        if wait and not worker.stop_at_once:
            worker.handle_sig_wait_for_completion(signal.SIGTERM)
        else:
            worker.handle_sig(signal.SIGTERM)


async def wait_stopped(
    tasks: list[asyncio.Task[Any]], workers: Sequence[SeamWorker], limit_s: float, *, force: bool
) -> list[Any]:
    """Wait for the workers' tasks after :func:`stop_workers`; repeat their cancel (once no
    job runs, or at once with ``force``), which Python 3.11 can lose when it races a timeout
    inside the poll loop: the process would then never exit."""
    pending = set(tasks)
    deadline = time.monotonic() + limit_s
    while pending and time.monotonic() < deadline:
        _, pending = await asyncio.wait(pending, timeout=0.5)
        for w in workers:
            # a stop_at_once worker's jobs were cancelled with it: repeat its cancel too
            idle = force or w.stop_at_once or (not w.allow_pick_jobs and not w.tasks)
            if idle and w.main_task is not None and not w.main_task.done():
                w.main_task.cancel()
    for task in pending:  # said where it stood: a stop that hangs must be found
        log.warning("%s did not stop within %.0f s (at %s)", task.get_name(), limit_s, where(task))
    await settle_cancelled(list(pending), 5.0)  # a lost cancel is sent again, for 5 s at most
    return [
        (t.exception() or t.result()) if t.done() and not t.cancelled() else None for t in tasks
    ]
