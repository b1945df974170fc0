"""The arq worker's jobs: fetch finished results, normalize them, fan them out.

``fetch_response`` (short-jobs queue) GETs a response (one not final yet is retried,
never stored), builds its envelope and writes it to every routed sink side by side; a
sink that fails gets its own ``deliver`` job (:mod:`receiver.worker.deliver`).
``fetch_batch`` (batches queue) streams a finished batch into the sinks
(:mod:`receiver.batches.runner`). :func:`land_response` lands a response the poller
already fetched. Every job runs under :func:`receiver.worker.retry.guarded`.

See docs/reliability.md (jobs, how it works) and docs/architecture.md (jobs).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from nopoll.envelope import DEFAULT_TENANT, Envelope, envelope_from_response
from nopoll.exceptions import (
    ProviderError,
    ResultNotReady,
    SinkError,
    TransientProviderError,
)
from nopoll.status import final_status, unfinished_status
from receiver.batches.runner import LeaseLost
from receiver.config.accounts import scoped
from receiver.providers import Dialect
from receiver.queue.jobs import FetchBatch, FetchJob, FetchResponse
from receiver.tracing import span
from receiver.watches.store import RECHECK_S, WatchStore
from receiver.worker.deliver import deliver, queue_retries
from receiver.worker.liveness import ServedAccounts
from receiver.worker.retry import dead_letter, hand_over, handles, retry_or_give_up
from receiver.worker.state import WorkerState

__all__ = [
    "deliver",
    "fetch_batch",
    "fetch_response",
    "land_event",
    "land_response",
]

log = logging.getLogger("nopoll.worker")


_J = TypeVar("_J", bound=FetchJob)
_Job = Callable[..., Awaitable[dict[str, Any]]]


def _fetch_job(
    job_type: type[_J],
) -> Callable[[Callable[[dict[str, Any], _J, Dialect], Awaitable[dict[str, Any]]]], _Job]:
    """The handler of ``job_type``'s fetch job (:func:`~receiver.worker.retry.handles`), run
    under :func:`~receiver.worker.retry.guarded` (its log lines carry the
    provider, the object's id and the event), its kwargs read as a ``job_type``, and its
    provider's dialect found first (with the tenant's key): a provider, or tenant account,
    no longer configured makes it a dead letter, unless another live worker serves it
    (:mod:`receiver.worker.liveness`): then it is left to that one."""

    function = job_type.function

    def wrap(body: Callable[[dict[str, Any], _J, Dialect], Awaitable[dict[str, Any]]]) -> _Job:
        @handles(function, "provider", job_type.id_field, "event_id")
        @functools.wraps(body)
        async def run(ctx: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            job = job_type.from_kwargs(kwargs)
            state: WorkerState = ctx["state"]
            dialect = state.dialect(job.provider, job.tenant)
            if dialect is None:
                if await ServedAccounts(state.redis).served(scoped(job.provider, job.tenant)):
                    return await hand_over(ctx, function)  # another live worker has it
                error = f"provider {job.provider!r} is no longer configured"
                if job.tenant != DEFAULT_TENANT:
                    error += f" for tenant {job.tenant!r}"
                return await dead_letter(ctx, function, job.to_kwargs(), error)
            # a callback's job continues its trace (a no-op while tracing is off)
            attributes = {"nopoll.provider": job.provider, "nopoll.id": job.object_id}
            with span(function, attributes, parent=job.traceparent, kind="consumer"):
                return await body(ctx, job, dialect)

        return run

    return wrap


@_fetch_job(FetchResponse)
async def fetch_response(
    ctx: dict[str, Any], job: FetchResponse, dialect: Dialect
) -> dict[str, Any]:
    """Fetch one finished response and fan it out (see module docs)."""
    watches = _watches(ctx)
    skipped = await _polled_already(ctx, watches, job)
    if skipped is not None:
        return skipped
    # a slot of the account's budget within a quarter of the job's time, else a retry later
    wait_s = ctx["state"].settings.worker.response_job_timeout_s / 4
    try:
        body = _trusted(job)
        if body is None:
            body = await dialect.fetch_response(job.response_id, wait_s=wait_s)
        status = unfinished_status(body)
        if status is not None:
            path = f"responses/{job.response_id}"
            raise ResultNotReady(provider=job.provider, path=path, status=status)
    except ProviderError as exc:
        return await _provider_failed(ctx, job, exc)
    state: WorkerState = ctx["state"]
    # the fetch event goes with the sinks' (one trip), stamped now
    fetched: dict[str, Any] = {"at": round(time.time(), 3), "kind": job.kind}
    fetched.update(status=str(body.get("status") or ""), **{"try": int(ctx.get("job_try") or 1)})
    envelope = envelope_from_response(
        body,
        provider=job.provider,
        received_at=job.received_at,
        event_id=job.event_id,
        tenant=job.tenant,
    )
    # the callback ends its watch (or, not watched yet, the marker says it landed)
    ended = _Ended(watches, job, envelope.status)
    landed = await _land(ctx, envelope, fetched=fetched, ended=ended)
    state.metrics.count_job(job.function, "ok")
    return landed


def _trusted(job: FetchResponse) -> dict[str, Any] | None:
    """A trusted completion webhook's object, when it is the response the job is about and
    final (else the job fetches it by id, as any callback's)."""
    pushed = job.pushed
    if pushed is None or pushed.get("id") != job.response_id:
        return None
    return pushed if final_status(pushed.get("status")) is not None else None


class _Ended:
    """A callback's (or the feed's) result landed: its watch ends ``landed`` (see
    :func:`_land`)."""

    __slots__ = ("job", "status", "via", "watches")

    def __init__(
        self, watches: WatchStore, job: FetchResponse, status: str, via: str = "callback"
    ) -> None:
        self.watches, self.job, self.status, self.via = watches, job, status, via

    def command(self) -> tuple[Any, ...]:
        job = self.job
        return self.watches.finish_command(
            *(job.provider, job.kind, job.response_id, "landed"),
            tenant=job.tenant,
            status=self.status,
            via=self.via,
        )

    async def run(self) -> None:
        job = self.job
        await self.watches.finish(
            *(job.provider, job.kind, job.response_id, "landed"),
            tenant=job.tenant,
            status=self.status,
            via=self.via,
        )


async def land_event(
    state: WorkerState, envelope: Envelope, *, completion_id: str, via: str = "feed"
) -> None:
    """Land a result a completion feed carried whole (no GET), ending its watch as a
    callback's result does; the feed's event goes on the id's journey."""
    assert envelope.response_id is not None
    job = FetchResponse(
        provider=envelope.provider,
        response_id=envelope.response_id,
        event_id=envelope.event_id,
        received_at=envelope.received_at,
        tenant=envelope.tenant,
    )
    ctx: dict[str, Any] = {"state": state}
    watches = _watches(ctx)
    # as a callback: the id's watch (or, not watched yet, a marker that a watch registered
    # later reads) learns the result is landing; a poll that landed it first wins
    if await _polled_already(ctx, watches, job) is not None:
        return
    fetched = {"at": round(time.time(), 3), "kind": job.kind, "via": via, "event": completion_id}
    fetched["status"] = envelope.status
    await _land(ctx, envelope, fetched=fetched, ended=_Ended(watches, job, envelope.status, via))


async def _provider_failed(
    ctx: dict[str, Any], job: FetchJob, exc: ProviderError
) -> dict[str, Any]:
    """The provider failed the fetch: the try on the id's journey, then a retry with backoff
    when the failure is transient, else a dead letter."""
    await _fetch_failed(ctx, job, exc)
    if isinstance(exc, TransientProviderError):
        error, retry_after_s = str(exc), exc.retry_after_s
        return await retry_or_give_up(ctx, job.function, job.to_kwargs(), error, retry_after_s)
    return await dead_letter(ctx, job.function, job.to_kwargs(), str(exc))


async def _fetch_failed(ctx: dict[str, Any], job: FetchJob, exc: ProviderError) -> None:
    """The failed try on the id's journey, with the provider's own words (in ``exc``)."""
    fields: dict[str, Any] = {"kind": job.kind, "try": int(ctx.get("job_try") or 1)}
    if exc.status is not None:
        fields["http"] = exc.status
    if isinstance(exc, ResultNotReady):
        fields["status"] = exc.object_status
    state: WorkerState = ctx["state"]
    await state.trail(job.provider, job.object_id, "fetch", job.tenant, error=str(exc), **fields)


def _recheck_s(ctx: dict[str, Any], provider: str) -> float:
    """How long a callback's job has to land a watched id before polling takes it back."""
    config = ctx["state"].settings.providers.get(provider)
    return max(RECHECK_S, config.watch.reconcile_after_s if config is not None else 0.0)


def _watches(ctx: dict[str, Any]) -> WatchStore:
    state: WorkerState = ctx["state"]
    if state.watches is not None:
        return state.watches
    return WatchStore(state.redis, ended_ttl_s=state.settings.dedupe_ttl_s)


async def _polled_already(
    ctx: dict[str, Any], watches: WatchStore, job: FetchJob
) -> dict[str, Any] | None:
    """Tell the id's watch a callback arrived. When its poll landed the id already (or is
    landing it), the job's answer (one delivery, not two); else None: fetch it."""
    provider, object_id, kind = job.provider, job.object_id, job.kind
    verdict = await watches.callback_arrived(
        provider, kind, object_id, tenant=job.tenant, recheck_s=_recheck_s(ctx, provider)
    )
    if verdict not in ("landed", "landing"):
        return None
    log.info(
        "%s %s/%s: a poll has %s it already; nothing to do", kind, provider, object_id, verdict
    )
    return {"skipped": verdict}


async def land_response(
    state: WorkerState,
    provider: str,
    body: dict[str, Any],
    *,
    event_id: str | None,
    received_at: str,
    tenant: str = DEFAULT_TENANT,
) -> dict[str, Any]:
    """Land a terminal Responses object fetched elsewhere (the watch poller's own poll: no
    second GET), exactly as ``fetch_response`` lands what it fetched."""
    envelope = envelope_from_response(
        body, provider=provider, received_at=received_at, event_id=event_id, tenant=tenant
    )
    return await _land({"state": state}, envelope)


async def _land(
    ctx: dict[str, Any],
    envelope: Envelope,
    *,
    fetched: dict[str, Any] | None = None,
    ended: _Ended | None = None,
) -> dict[str, Any]:
    """Write ``envelope`` to every routed sink side by side; a sink that failed gets its own
    delivery (a sink that refused it, a dead letter); then the result's log line.

    The trail's events (the ``fetched`` event of a job that fetched it, then the sinks')
    and the end of the watch (``ended``) share one round trip with the other jobs' when
    every sink took it; when one failed, its retry is queued before the watch ends."""
    state: WorkerState = ctx["state"]
    shares = state.fanout.route([envelope])
    failures = await state.fanout.write(shares)
    events: list[tuple[str, Mapping[str, Any]]] = []
    if fetched is not None:
        events.append(("fetch", fetched))
    sinks = sorted(n for n in shares if n not in failures)
    events.append(("sink", {"sinks": sinks, "failed": sorted(failures)}))
    if state.trips is None or state.journey is None:
        for step, fields in events:
            await state.trail(envelope.provider, envelope.key, step, envelope.tenant, **fields)
        trail: list[tuple[Any, ...]] = []
    else:
        at = (envelope.provider, envelope.key)
        trail = state.journey.steps_commands(*at, events, envelope.tenant)
    if failures:
        if trail:
            await state.send_trail(trail)
            trail = []
        await queue_retries(ctx, failures, shares)
    if ended is not None and state.trips is not None:
        # the job's own end (its queue keys gone) rides in the same trip: one trip fewer
        end = ctx["end_command"](state.trips) if "end_command" in ctx else None
        [reply, *_] = await state.send_trail(trail, ended.command(), *([end] if end else []))
        if isinstance(reply, Exception):
            raise reply
    else:
        if trail:
            await state.send_trail(trail)
        if ended is not None:
            await ended.run()
    if log.isEnabledFor(logging.INFO):
        _log_landed(envelope, shares, failures)
    return {"sinks": len(shares), "failed": sorted(failures)}


def _log_landed(
    env: Envelope, shares: Mapping[str, Sequence[Envelope]], failures: Mapping[str, SinkError]
) -> None:
    """One line per result: where it landed, and which sinks retry it on their own."""
    where = f"{env.kind} {env.provider}/{env.key}"
    landed = ", ".join(sorted(n for n in shares if n not in failures))
    if not failures:
        log.info("%s landed (%s) in %s", where, env.status, landed)
        return
    failed = ", ".join(sorted(failures))
    if landed:
        msg = "%s landed (%s) in %s; %s failed and is retried on its own"
        log.info(msg, where, env.status, landed, failed)
    else:
        msg = "%s fetched (%s); %s failed and is retried on its own"
        log.info(msg, where, env.status, failed)


@_fetch_job(FetchBatch)
async def fetch_batch(ctx: dict[str, Any], job: FetchBatch, dialect: Dialect) -> dict[str, Any]:
    """Stream every row of a finished batch into the sinks (see :mod:`receiver.batches.runner`)."""
    state: WorkerState = ctx["state"]
    if not job.from_watch:  # a poll queued this job itself after claiming the landing
        skipped = await _polled_already(ctx, _watches(ctx), job)
        if skipped is not None:
            return skipped
    lease = ctx.get("leases", {}).get(ctx.get("job_id"))
    try:
        outcome = await state.batch_runner.run(dialect, lease=lease, **job.runner_kwargs())
    except LeaseLost as exc:
        # Another run may own the batch now: this one stops and leaves the job to it.
        log.warning("batch %s/%s: %s; this run stopped", job.provider, job.batch_id, exc)
        return {"lease_lost": True}
    except ProviderError as exc:
        if isinstance(exc, TransientProviderError):
            state.metrics.batches.labels(job.provider, "retry").inc()
        return await _provider_failed(ctx, job, exc)
    except SinkError as exc:
        return await retry_or_give_up(ctx, job.function, job.to_kwargs(), str(exc))
    if not job.from_watch:  # the callback ended its watch, or marks the id landed
        await _watches(ctx).finish(
            job.provider, job.kind, job.batch_id, "landed", tenant=job.tenant, via="callback"
        )
    done = "already_done" if outcome.already_done else "ok"
    state.metrics.batches.labels(job.provider, done).inc()
    state.metrics.count_job(job.function, "ok")
    return {"rows": outcome.rows, "skipped_chunks": outcome.chunks_skipped}
