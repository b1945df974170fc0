"""nopoll's arq workers: the seam's :class:`~receiver.queue._arq.SeamWorker` with nopoll's policy.

:class:`NopollWorker` keeps what arq gives up on as a dead letter and publishes sink
health at each heartbeat; :func:`build_workers` wires the two workers of a process (short
jobs, batches) with each job's own deadline below arq's timeout. The start-up and shutdown
hooks (:func:`startup`, :func:`shutdown`) open the process's one
:class:`~receiver.worker.state.WorkerState` for its workers, with its heartbeat, its watch
poller and the publication of the accounts it serves, and close them again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from redis.exceptions import RedisError

from nopoll.envelope import now_rfc3339
from receiver.aio import cancel_and_wait
from receiver.config.settings import Settings
from receiver.fanout.health import publish_sink_health
from receiver.feeds.store import feed_accounts
from receiver.metrics import Metrics
from receiver.queue._arq import (
    Function,
    GivenUp,
    SeamWorker,
    arq_pool,
    func,
    job_deserializer,
    job_serializer,
)
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import HEALTH_CHECK_KEY
from receiver.queue.jobs import (
    BATCHES_QUEUE,
    JOBS,
    JOBS_QUEUE,
    JobSpec,
    fetch_from_job_id,
)
from receiver.redis.connector import RedisConnector
from receiver.worker import fetch as _fetch  # noqa: F401  (registers the jobs' handlers)
from receiver.worker.feed import FeedFollower
from receiver.worker.gc_policy import GcPolicy
from receiver.worker.liveness import Liveness, accounts_of, held_jobs_key, new_worker_id
from receiver.worker.poller import WatchPoller
from receiver.worker.retry import handler_for, keep_letter
from receiver.worker.state import WorkerState, build_state

__all__ = ["NopollWorker", "Shared", "build_workers", "hand_back", "shutdown", "startup"]

log = logging.getLogger("nopoll.worker")

_ARQ_SLACK = 5
"""arq's own try limit sits this far above ours, so our code always sees the last try
and keeps it as a dead letter (arq would drop it with only a log line)."""


_TRIM_LETTERS_S = 60.0
"""How often a worker drops expired dead letters (:meth:`DeadLetters.expire`)."""


class NopollWorker(SeamWorker):
    """A seam worker that keeps every job arq gives up on, reports sink health and trims
    the dead letters (expired ones, tenants over their cap)."""

    _letters_trimmed = float("-inf")

    async def give_up(self, job: GivenUp) -> None:
        function, kwargs = job.function, job.kwargs
        if function is None or kwargs is None:
            function, kwargs = _from_job_id(job.job_id)
        metrics: Metrics | None = self.ctx.get("metrics")
        settings: Settings | None = self.ctx.get("settings")
        letters = DeadLetters(
            self.pool,
            limits=None if settings is None else settings.dead_letters,
            on_dropped=None if metrics is None else metrics.letters_dropped,
        )
        args = (function, kwargs, job.tries, job.reason)
        letter = await keep_letter(letters, metrics, job.job_id, *args)
        log.error("dead letter %s: arq gave up on job %s", letter.id, job.job_id)

    async def health_checked(self) -> None:
        fanout = self.ctx.get("fanout")
        if fanout is not None:
            await publish_sink_health(self.pool, fanout, 3 * self.health_check_interval + 5)
        state = self.ctx.get("state")
        now = time.monotonic()
        if state is not None and now - self._letters_trimmed >= _TRIM_LETTERS_S:
            self._letters_trimmed = now
            try:  # expired letters, and tenants over their cap
                await state.dead_letters.expire()
            except (RedisError, OSError):
                raise  # the poll loop waits for Redis
            except Exception:
                log.exception("trimming the dead letters failed; tried again in a minute")


def _from_job_id(job_id: str) -> tuple[str, dict[str, Any]]:
    """What a job was, from its id alone (its payload expired or cannot be read)."""
    fetch = fetch_from_job_id(job_id, received_at=now_rfc3339())
    if fetch is not None:
        return fetch
    # A delivery whose payload is gone cannot be redone; the letter says so and is kept.
    return "", {"job_id": job_id}


def build_workers(
    settings: Settings,
    redis: RedisConnector,
    metrics: Metrics,
    *,
    handle_signals: bool = True,
    extra_ctx: dict[str, Any] | None = None,
    worker_id: str | None = None,
) -> list[NopollWorker]:
    """The arq Workers: short jobs on :data:`JOBS_QUEUE`, batches on :data:`BATCHES_QUEUE`;
    ``worker_id``: the process's id claimed by
    :func:`~receiver.worker.liveness.claim_identity` (None: a random one)."""
    w = settings.worker
    tries = max(settings.fetch_retry.max_tries, settings.sink_retry.max_tries) + _ARQ_SLACK

    def job(spec: JobSpec) -> Function:
        coroutine: Any = handler_for(spec.name)  # the one registered for it (retry.handles)
        # arq's timeout sits above the job's own deadline: nopoll's always fires first.
        return func(coroutine, name=spec.name, timeout=spec.rules(settings).arq_timeout_s)

    def functions(queue: str) -> list[Function]:
        return [job(spec) for spec in JOBS.values() if spec.queue == queue]

    def timeout_s(queue: str) -> float:
        return max(s.rules(settings).arq_timeout_s for s in JOBS.values() if s.queue == queue)

    # One WorkerState for the process's workers (see startup below), and one
    # liveness: their claims and the watch poller's takes all name this process.
    extra = dict(extra_ctx or {})
    liveness = Liveness(
        redis,
        worker_id=worker_id,
        claimed=worker_id is not None,
        accounts=accounts_of(settings),
        sinks=frozenset(settings.sinks),
        prints={name: config.fingerprint() for name, config in settings.sinks.items()},
        accounts_every_s=w.health_check_interval_s,
    )
    shared = Shared(redis, transport=extra.pop("provider_transport", None), liveness=liveness)
    extra_ctx = {"shared": shared, **extra}
    common: dict[str, Any] = {
        "redis": redis,
        "metrics": metrics,
        "handle_signals": handle_signals,
        "extra_ctx": extra_ctx,
        "tries": tries,
        "worker_id": liveness.worker_id,
        "held_key": held_jobs_key(liveness.worker_id),
    }
    return [
        _worker(
            settings,
            functions(JOBS_QUEUE),
            JOBS_QUEUE,
            w.max_jobs,
            timeout_s(JOBS_QUEUE),
            HEALTH_CHECK_KEY,
            # nopoll's deadline ends every job before arq's timeout: the lock needs no more
            claim_ttl_s=timeout_s(JOBS_QUEUE),
            **common,
        ),
        _worker(
            settings,
            functions(BATCHES_QUEUE),
            BATCHES_QUEUE,
            settings.batch.max_jobs,
            timeout_s(BATCHES_QUEUE),
            BATCHES_QUEUE + ":health-check",
            # a batch job renews its lock as a lease: a killed worker's batch resumes soon
            claim_ttl_s=settings.batch.lease_s,
            # on stop, a batch is cancelled and resumes on another worker at once
            stop_at_once=True,
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
    stop_at_once: bool = False,
    worker_id: str,
    held_key: str,
    redis: RedisConnector,
    metrics: Metrics,
    handle_signals: bool,
    extra_ctx: dict[str, Any] | None,
    tries: int,
) -> NopollWorker:
    w = settings.worker
    # Batches arrive a few a day: their queue need not be polled 50 times a second.
    poll_delay = w.poll_delay_s if queue == JOBS_QUEUE else max(w.poll_delay_s, 0.25)
    return NopollWorker(
        functions,
        claim_ttl_s=claim_ttl_s,
        idle_wait_s=w.idle_wait_s,
        worker_id=worker_id,
        held_key=held_key,
        stop_at_once=stop_at_once,
        queue_name=queue,
        redis_pool=arq_pool(redis, queue=queue, expires_ms=settings.job_expiry_s * 1000),
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


@dataclass
class Shared:
    """The process's one :class:`WorkerState`, shared by its arq workers (``ctx["shared"]``)."""

    redis: RedisConnector
    transport: httpx.AsyncBaseTransport | None = None
    state: WorkerState | None = None
    users: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    gc: GcPolicy = field(default_factory=GcPolicy)
    """The cyclic GC's settings while the state is open (:mod:`receiver.worker.gc_policy`)."""
    poller: asyncio.Task[None] | None = None
    """The process's watch poller (:mod:`receiver.worker.poller`), started with the state."""
    feeds: asyncio.Task[None] | None = None
    """The process's offer to follow the completion feeds (:mod:`receiver.worker.feed`)."""
    liveness: Liveness | None = None
    """The process's heartbeat and the accounts it serves (:mod:`receiver.worker.liveness`),
    beating while the state is open."""


async def startup(ctx: dict[str, Any]) -> None:
    """arq start-up hook: the process's state in ``ctx["state"]`` (built by the first
    worker to start, opened once)."""
    shared: Shared = ctx["shared"]
    first = shared.state is None
    if shared.state is None:  # no await before it is set: a second worker sees it
        shared.state = build_state(
            ctx["settings"], shared.redis, ctx["metrics"], transport=shared.transport
        )
    shared.users += 1
    ctx["state"] = shared.state
    ctx["fanout"] = shared.state.fanout  # for the heartbeat's sink health
    if first:
        if shared.liveness is not None:
            await shared.liveness.start()  # known as alive before its first claim
        await shared.state.open()
        shared.gc.apply()
        if shared.state.settings.providers:
            owner = shared.liveness.worker_id if shared.liveness is not None else None
            poller = WatchPoller(shared.state, owner=owner)
            shared.poller = asyncio.create_task(poller.run(), name="watch poller")
            if feed_accounts(shared.state.settings):
                follower = FeedFollower(shared.state, owner=owner or new_worker_id())
                shared.feeds = asyncio.create_task(follower.run(), name="completion feeds")


async def hand_back(shared: Shared) -> None:
    """Stopping (SIGTERM): stop polling watches and make the ones this process took due
    now for the other workers, instead of after their lease."""
    await _stop_poller(shared)
    if shared.liveness is not None:
        try:
            n = await shared.liveness.hand_back_watches()
        except (RedisError, OSError) as exc:
            log.warning("could not hand back this worker's watches (%s)", type(exc).__name__)
        else:
            if n:
                log.info("handed back %d watch(es) being polled", n)


async def _stop_poller(shared: Shared) -> None:
    """Cancel the watch poller and the feed follower (which gives its feeds up) and wait
    for them, 30 s at most each (a poll ends within its HTTP timeout anyway)."""
    for task in (shared.poller, shared.feeds):
        if task is not None:
            await cancel_and_wait(task, 30.0)
    shared.poller = shared.feeds = None


async def shutdown(ctx: dict[str, Any]) -> None:
    """arq shutdown hook: close the state once the process's last worker stops."""
    shared: Shared = ctx["shared"]
    shared.users -= 1
    if shared.users <= 0 and shared.state is not None:
        state, shared.state = shared.state, None
        await _stop_poller(shared)
        if shared.liveness is not None:
            await shared.liveness.stop()  # nothing of this process runs any more
        shared.gc.restore()
        await state.aclose()
