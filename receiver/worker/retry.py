"""What every worker job shares: its own deadline, its retry rule, and its dead letter.

arq fails a job for good, with only a log line, on any exception but ``Retry``, on its
own timeout and past ``max_tries``; nopoll promises rows or a dead letter that says why.
So every job runs under :func:`guarded`: a deadline :data:`JOB_GRACE_S` before arq's,
Redis errors retried, any other exception a dead letter, and a job that never finishes
a dead letter after ``max_tries + 2`` runs.

See docs/reliability.md (how it works, retries and their bound).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from receiver.logs import Throttle, bind
from receiver.metrics import Metrics
from receiver.queue._arq import RETRY_KEY, Retry
from receiver.queue.deadletter import REPLAY_PREFIX, DeadLetter, DeadLetters
from receiver.queue.jobs import PayloadVersionError, job_spec
from receiver.worker.liveness import ServedAccounts
from receiver.worker.state import WorkerState

__all__ = [
    "dead_letter",
    "guarded",
    "hand_over",
    "handler_for",
    "handles",
    "keep_letter",
    "retry_or_give_up",
]

log = logging.getLogger("nopoll.worker")

_Job = Callable[..., Awaitable[dict[str, Any]]]

_HANDLERS: dict[str, _Job] = {}
"""The handler of each job function of :data:`~receiver.queue.jobs.JOBS`, by name."""


async def dead_letter(
    ctx: dict[str, Any], function: str, kwargs: dict[str, Any], error: str
) -> dict[str, Any]:
    """Keep the job's work as a replayable dead letter. When Redis cannot take the letter,
    the job is retried instead (a letter is never dropped for want of a place to keep it)."""
    state: WorkerState = ctx["state"]
    job_try = int(ctx.get("job_try") or 1)
    job_id = str(ctx.get("job_id") or "")
    try:
        letter = await keep_letter(
            state.dead_letters, state.metrics, job_id, function, kwargs, job_try, error
        )
    except (RedisError, OSError) as exc:
        log.warning("cannot keep a dead letter now (%s); running the job again later", exc)
        raise Retry(defer=job_spec(function).rules(state.settings).retry.delay(job_try)) from None
    state.metrics.count_job(function, "dead_letter")
    keys = letter.keys
    shown = ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
    log.error(
        "dead letter %s: %s %s after %d tries: %s", letter.id, letter.sink, shown, job_try, error
    )
    return {"dead_letter": letter.id}


async def keep_letter(
    letters: DeadLetters,
    metrics: Metrics | None,
    job_id: str,
    function: str,
    kwargs: dict[str, Any],
    attempts: int,
    error: str,
) -> DeadLetter:
    """Keep a job's work as a dead letter (:meth:`DeadLetters.keep`) and count it, unless it
    is a replay's (counted when first kept): what a failed job and arq's give-up share."""
    letter = await letters.keep(function, kwargs, attempts=attempts, error=error)
    if metrics is not None and not job_id.startswith(REPLAY_PREFIX):
        metrics.dead_letters.labels(letter.sink).inc()
    return letter


async def hand_over(ctx: dict[str, Any], function: str) -> dict[str, Any]:
    """Leave the job to another worker (it is for a provider or a sink this process lacks
    and another live one has): run it again shortly, this run not counted as a try."""
    state: WorkerState = ctx["state"]
    job_id = ctx.get("job_id")
    if job_id:
        await state.redis.decr(RETRY_KEY + str(job_id))
    log.debug("%s left to another worker (one that has its provider, sink or version)", function)
    interval = state.settings.worker.health_check_interval_s
    raise Retry(defer=min(5.0, interval) * random.uniform(0.5, 1.0))


async def retry_or_give_up(
    ctx: dict[str, Any],
    function: str,
    kwargs: dict[str, Any],
    error: str,
    retry_after_s: float | None = None,
) -> dict[str, Any]:
    """Retry the job with backoff, or keep it as a dead letter after its last try."""
    state: WorkerState = ctx["state"]
    rules = job_spec(function).rules(state.settings)
    job_try = int(ctx.get("job_try") or 1)
    if job_try >= rules.retry.max_tries:
        return await dead_letter(ctx, function, kwargs, error)
    state.metrics.count_job(function, "retry")
    log.info("%s try %d failed (%s); retrying", function, job_try, error)
    raise Retry(defer=rules.retry.delay(job_try, retry_after_s))


def guarded(function: str, *log_fields: str) -> Callable[[_Job], _Job]:
    """Run a job under its deadline and retry rule; bind ``log_fields`` to its log lines."""

    def wrap(job: _Job) -> _Job:
        @functools.wraps(job)
        async def run(ctx: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            fields = {n: kwargs.get(n) for n in log_fields}
            with bind(job_id=ctx.get("job_id"), job_try=ctx.get("job_try"), **fields):
                return await _guard(ctx, function, job, kwargs)

        return run

    return wrap


async def _guard(
    ctx: dict[str, Any], function: str, job: _Job, kwargs: dict[str, Any]
) -> dict[str, Any]:
    rules = job_spec(function).rules(ctx["state"].settings)
    job_try = int(ctx.get("job_try") or 1)
    if job_try > rules.retry.max_tries + 2:
        error = f"job ran {job_try} times without finishing (worker crashes?)"
        return await dead_letter(ctx, function, kwargs, error)
    try:
        try:
            async with asyncio.timeout(rules.deadline_s) as scope:
                return await job(ctx, **kwargs)
        except TimeoutError:
            if not scope.expired():
                raise  # someone else's timeout: handled below like any OSError
            error = f"did not finish within {rules.deadline_s:g} s"
            return await retry_or_give_up(ctx, function, kwargs, error)
    except Retry:
        raise
    except PayloadVersionError as exc:  # written by a newer nopoll: to a worker that reads it
        if await ServedAccounts(ctx["state"].redis).reads(exc.mark):
            ctx["state"].metrics.count_job(function, "handed_back")
            _say_unread(exc, "a live worker reads it: left to it")
            return await hand_over(ctx, function)
        # none yet (the API rolled before the workers): wait for one, with the job's
        # backoff and tries; a dead letter only once they are spent
        _say_unread(exc, "no live worker reads it yet: retrying")
        return await retry_or_give_up(ctx, function, kwargs, str(exc))
    except (RedisError, OSError) as exc:
        # Redis went away mid-job: run it again later. Nothing it did is lost: a rewrite
        # overwrites in sql and s3 (kafka, http and jsonl deliver at least once), and a
        # batch resumes after its last committed chunk.
        log.warning("%s stopped by %s; retrying", function, type(exc).__name__)
        raise Retry(defer=rules.retry.delay(job_try)) from None
    except Exception as exc:  # a bug of ours or an object we cannot handle: keep the work
        log.exception("%s failed unexpectedly", function)
        return await dead_letter(ctx, function, kwargs, f"{type(exc).__name__}: {exc}"[:500])


_UNREAD = Throttle(log, every_s=60.0)
"""Jobs left to a worker that reads their version: one line per version a minute."""


def _say_unread(exc: PayloadVersionError, then: str) -> None:
    """Say (one line per version and outcome a minute) that a job is of a version this
    worker does not read (a rolling upgrade: a newer nopoll queued it), and ``then``
    what becomes of it."""
    _UNREAD.log(logging.WARNING, (exc.mark, then), "%s; %s", str(exc).partition(":")[0], then)


def handles(function: str, *log_fields: str) -> Callable[[_Job], _Job]:
    """Register the decorated coroutine as the handler of ``function`` (a row of
    :data:`~receiver.queue.jobs.JOBS`), run under :func:`guarded`: what the worker runs
    for a job of that name (:func:`handler_for`)."""
    name = job_spec(function).name

    def wrap(job: _Job) -> _Job:
        if name in _HANDLERS:
            raise ValueError(f"job {name!r} has a handler already")
        run = guarded(name, *log_fields)(job)
        _HANDLERS[name] = run
        return run

    return wrap


def handler_for(function: str) -> _Job:
    """The handler registered for ``function`` (:func:`handles`)."""
    try:
        return _HANDLERS[function]
    except KeyError:
        raise ValueError(f"no handler for job {function!r}") from None
