"""The arq worker: fetch finished results, normalize them, fan them out.

Jobs (all JSON, on :data:`~receiver.queue.JOBS_QUEUE`):

``fetch_response(provider, response_id, event_id, received_at)``
    GET the response, build its envelope, write it to every routed sink. A transient
    provider failure retries the job with backoff (arq ``Retry``); after the last try,
    or on a permanent failure, the fetch becomes a dead letter. A sink that fails gets
    its own ``deliver`` job, so it is retried alone.
``deliver(sink, envelopes)``
    Write envelopes to one sink, with backoff; after the last try, a dead letter.

arq facts this relies on: any exception other than ``Retry`` fails a job for good, so
every failure here is turned into ``Retry`` or a dead letter; a job killed mid-run is
run again once its in-progress lock expires (``job timeout + 10 s``), and every sink
write is idempotent, so the re-run leaves exactly one row.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from arq import Retry
from arq.connections import ArqRedis
from redis.exceptions import RedisError

from receiver.batches import BatchRunner, claim_summary
from receiver.config import Settings
from receiver.deadletter import DeadLetters
from receiver.envelope import Envelope, envelope_from_response
from receiver.exceptions import ProviderError, SinkError, SinkRejected, TransientProviderError
from receiver.fanout import FanOut, ManagedSink
from receiver.logs import bind
from receiver.metrics import Metrics
from receiver.providers import Dialect, ProviderClient, dialect_for
from receiver.queue import JOBS_QUEUE
from receiver.routing import Router

__all__ = ["deliver", "fetch_batch", "fetch_response", "shutdown", "startup"]

log = logging.getLogger("nopoll.worker")
_Job = Callable[..., Awaitable[dict[str, Any]]]


async def startup(ctx: dict[str, Any]) -> None:
    """Put one pooled client per provider and the (lazily opened) sinks in ``ctx``."""
    settings: Settings = ctx["settings"]
    metrics: Metrics = ctx["metrics"]
    ctx["dialects"] = {
        name: dialect_for(
            cfg.dialect,
            ProviderClient(
                name,
                cfg,
                settings.http,
                transport=ctx.get("provider_transport"),
                on_request=metrics.observe_provider_request,
            ),
        )
        for name, cfg in settings.providers.items()
    }
    sinks = {name: ManagedSink(name, cfg, metrics) for name, cfg in settings.sinks.items()}
    ctx["fanout"] = FanOut(sinks, Router(settings.routes, list(sinks)), metrics)
    ctx["dead_letters"] = DeadLetters(ctx["redis"])
    ctx["batch_runner"] = BatchRunner(
        settings,
        redis=ctx["redis"],
        fanout=ctx["fanout"],
        dead_letters=ctx["dead_letters"],
        metrics=metrics,
    )
    # Open sinks now so start-up problems show early; a sink that is down is retried later.
    for name, sink in sinks.items():
        try:
            await sink.write([])
        except Exception as exc:
            log.warning("sink %s is not ready yet: %s", name, exc)


async def shutdown(ctx: dict[str, Any]) -> None:
    """Close provider clients and sinks."""
    for dialect in ctx.get("dialects", {}).values():
        await dialect.client.aclose()
    if "fanout" in ctx:
        await ctx["fanout"].aclose()


async def _dead_letter(
    ctx: dict[str, Any],
    *,
    sink: str,
    provider: str,
    keys: list[str],
    error: str,
    function: str,
    kwargs: dict[str, Any],
) -> None:
    letters: DeadLetters = ctx["dead_letters"]
    letter = await letters.add(
        sink=sink,
        provider=provider,
        keys=keys,
        attempts=ctx["job_try"],
        error=error,
        function=function,
        kwargs=kwargs,
    )
    ctx["metrics"].dead_letters.labels(sink).inc()
    log.error(
        "dead letter %s: %s %s after %d tries: %s", letter.id, sink, keys[:3], ctx["job_try"], error
    )


async def _queue_retries(
    ctx: dict[str, Any], failures: dict[str, Exception], shares: dict[str, list[Envelope]]
) -> None:
    settings: Settings = ctx["settings"]
    redis: ArqRedis = ctx["redis"]
    for name, error in failures.items():
        log.warning("sink %s failed, retrying on its own: %s", name, error)
        await redis.enqueue_job(
            "deliver",
            sink=name,
            envelopes=[e.to_dict() for e in shares[name]],
            _job_id=f"deliver:{name}:{uuid.uuid4().hex}",
            _queue_name=JOBS_QUEUE,
            _defer_by=settings.sink_retry.delay(1),
            _job_try=2,
        )


def _logged(*names: str) -> Callable[[_Job], Any]:
    """Bind the job's id, try and the named arguments to every log line it writes."""

    def wrap(job: _Job) -> Any:
        @functools.wraps(job)
        async def run(ctx: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            fields = {n: kwargs.get(n) for n in names}
            with bind(job_id=ctx.get("job_id"), job_try=ctx.get("job_try"), **fields):
                return await job(ctx, **kwargs)

        return run

    return wrap


class _FetchJob:
    """What fetch_response and fetch_batch share: giving up into a dead letter, and the
    checks before any provider request."""

    def __init__(
        self, ctx: dict[str, Any], function: str, provider: str, key: str, kwargs: dict[str, Any]
    ) -> None:
        self.ctx, self.function, self.provider, self.key, self.kwargs = (
            ctx,
            function,
            provider,
            key,
            kwargs,
        )

    async def give_up(self, error: str) -> dict[str, Any]:
        """Keep the job as a dead letter (replayable) instead of failing it in arq."""
        await _dead_letter(
            self.ctx,
            sink="fetch",
            provider=self.provider,
            keys=[self.key],
            error=error,
            function=self.function,
            kwargs=self.kwargs,
        )
        self.ctx["metrics"].jobs.labels(self.function, "dead_letter").inc()
        return {"dead_letter": True}

    def dialect(self) -> tuple[Dialect | None, str]:
        """The provider's dialect, or why this job must not run again."""
        job_try: int = self.ctx["job_try"]
        limit = self.ctx["settings"].fetch_retry.max_tries + 2
        if job_try > limit:
            return None, f"job ran {job_try} times without finishing (worker crashes?)"
        dialect: Dialect | None = self.ctx["dialects"].get(self.provider)
        if dialect is None:
            return None, f"provider {self.provider!r} is no longer configured"
        return dialect, ""


@_logged("provider", "response_id", "event_id")
async def fetch_response(
    ctx: dict[str, Any],
    *,
    provider: str,
    response_id: str,
    event_id: str | None = None,
    received_at: str,
    tenant: str = "default",
) -> dict[str, Any]:
    """Fetch one finished response and fan it out (see module docs)."""
    settings: Settings = ctx["settings"]
    metrics: Metrics = ctx["metrics"]
    job_try: int = ctx["job_try"]
    retry = settings.fetch_retry
    job = _FetchJob(
        ctx,
        "fetch_response",
        provider,
        response_id,
        {
            "provider": provider,
            "response_id": response_id,
            "event_id": event_id,
            "received_at": received_at,
            "tenant": tenant,
        },
    )
    give_up = job.give_up
    dialect, refusal = job.dialect()
    if dialect is None:
        return await give_up(refusal)
    try:
        async with asyncio.timeout(settings.worker.response_job_timeout_s * 0.8):
            body = await dialect.fetch_response(response_id)
            envelope = envelope_from_response(
                body, provider=provider, received_at=received_at, event_id=event_id, tenant=tenant
            )
    except (TransientProviderError, TimeoutError) as exc:
        error = str(exc) if isinstance(exc, TransientProviderError) else "fetch timed out"
        if job_try >= retry.max_tries:
            return await give_up(error)
        retry_after = exc.retry_after_s if isinstance(exc, TransientProviderError) else None
        metrics.jobs.labels("fetch_response", "retry").inc()
        log.info("fetch %s/%s try %d failed (%s); retrying", provider, response_id, job_try, error)
        raise Retry(defer=retry.delay(job_try, retry_after)) from None
    except ProviderError as exc:
        return await give_up(str(exc))
    except Exception as exc:  # a provider object we cannot normalize: keep it, do not crash
        log.exception("cannot process response %s/%s", provider, response_id)
        return await give_up(f"{type(exc).__name__}: {exc}"[:500])

    fanout: FanOut = ctx["fanout"]
    shares = fanout.route([envelope])
    failures = await fanout.write(shares)
    if failures:
        await _queue_retries(ctx, dict(failures), shares)
    metrics.jobs.labels("fetch_response", "ok").inc()
    return {"sinks": len(shares), "failed": sorted(failures)}


@_logged("sink", "batch_state")
async def deliver(
    ctx: dict[str, Any],
    *,
    sink: str,
    envelopes: list[dict[str, Any]],
    batch_state: str | None = None,
    part: int | None = None,
) -> dict[str, Any]:
    """Write envelopes to one sink; retry with backoff, then keep as a dead letter.

    ``part`` is the chunk number of handed-off batch rows (S3 names its part files by
    it). ``batch_state`` names their batch: the delivery that settles the sink's last
    handed-off chunk writes the batch summary to that sink.
    """
    result = await _deliver(ctx, sink=sink, envelopes=envelopes, part=part)
    if batch_state is not None:
        remaining = await ctx["redis"].hincrby(batch_state, f"h:{sink}", -1)
        if remaining <= 0:
            await claim_summary(ctx["batch_runner"], batch_state, sink)
    return result


async def _deliver(
    ctx: dict[str, Any], *, sink: str, envelopes: list[dict[str, Any]], part: int | None
) -> dict[str, Any]:
    settings: Settings = ctx["settings"]
    metrics: Metrics = ctx["metrics"]
    job_try: int = ctx["job_try"]
    fanout: FanOut = ctx["fanout"]
    keys = [str(e.get("key")) for e in envelopes]
    provider = str(envelopes[0].get("provider")) if envelopes else ""
    # A replayed dead letter must not count down a batch's hand-offs a second time.
    kwargs: dict[str, Any] = {"sink": sink, "envelopes": envelopes, "part": part}
    target = fanout.sinks.get(sink)
    if target is None:
        await _dead_letter(
            ctx,
            sink=sink,
            provider=provider,
            keys=keys,
            error=f"sink {sink!r} is no longer configured",
            function="deliver",
            kwargs=kwargs,
        )
        return {"dead_letter": True}
    try:
        batch = [Envelope.from_dict(e) for e in envelopes]
        if part is None:
            await target.write(batch)
        else:
            await target.write_part(part, batch)
    except Exception as exc:
        # A subscriber that rejects the payload (a 4xx other than 408/429) will not change
        # its mind: keep it as a dead letter at once.
        if job_try >= settings.sink_retry.max_tries or isinstance(exc, SinkRejected):
            await _dead_letter(
                ctx,
                sink=sink,
                provider=provider,
                keys=keys,
                error=str(exc),
                function="deliver",
                kwargs=kwargs,
            )
            metrics.jobs.labels("deliver", "dead_letter").inc()
            return {"dead_letter": True}
        metrics.jobs.labels("deliver", "retry").inc()
        log.info("sink %s try %d failed (%s); retrying", sink, job_try, exc)
        retry_after = getattr(exc, "retry_after_s", None)
        raise Retry(defer=settings.sink_retry.delay(job_try, retry_after)) from None
    metrics.jobs.labels("deliver", "ok").inc()
    return {"rows": len(envelopes)}


@_logged("provider", "batch_id", "event_id")
async def fetch_batch(
    ctx: dict[str, Any],
    *,
    provider: str,
    batch_id: str,
    event_id: str | None = None,
    received_at: str,
    event_type: str = "batch.completed",
    tenant: str = "default",
) -> dict[str, Any]:
    """Stream every row of a finished batch into the sinks (see :mod:`receiver.batches`)."""
    settings: Settings = ctx["settings"]
    metrics: Metrics = ctx["metrics"]
    job_try: int = ctx["job_try"]
    retry = settings.fetch_retry
    job = _FetchJob(
        ctx,
        "fetch_batch",
        provider,
        batch_id,
        {
            "provider": provider,
            "batch_id": batch_id,
            "event_id": event_id,
            "received_at": received_at,
            "event_type": event_type,
            "tenant": tenant,
        },
    )
    give_up = job.give_up
    dialect, refusal = job.dialect()
    if dialect is None:
        return await give_up(refusal)
    runner: BatchRunner = ctx["batch_runner"]
    try:
        outcome = await runner.run(
            dialect,
            provider=provider,
            batch_id=batch_id,
            event_id=event_id,
            received_at=received_at,
            tenant=tenant,
            job_id=ctx.get("job_id"),
        )
    except TransientProviderError as exc:
        if job_try >= retry.max_tries:
            return await give_up(str(exc))
        metrics.batches.labels(provider, "retry").inc()
        log.info("batch %s/%s try %d failed (%s); resuming later", provider, batch_id, job_try, exc)
        raise Retry(defer=retry.delay(job_try, exc.retry_after_s)) from None
    except ProviderError as exc:
        return await give_up(str(exc))
    except (SinkError, RedisError, OSError) as exc:
        if job_try >= retry.max_tries:
            return await give_up(str(exc))
        log.warning(
            "batch %s/%s try %d stopped (%s); resuming later", provider, batch_id, job_try, exc
        )
        raise Retry(defer=retry.delay(job_try)) from None
    except Exception as exc:  # a batch we cannot read: keep it, do not crash the worker
        log.exception("cannot process batch %s/%s", provider, batch_id)
        return await give_up(f"{type(exc).__name__}: {exc}"[:500])
    metrics.batches.labels(provider, "already_done" if outcome.already_done else "ok").inc()
    return {"rows": outcome.rows, "skipped_chunks": outcome.chunks_skipped}
