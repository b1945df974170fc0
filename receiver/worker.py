"""The arq worker's jobs: fetch finished results, normalize them, fan them out.

``fetch_response(provider, response_id, event_id, received_at)`` (short-jobs queue)
    GET the response; a response that is not terminal yet is retried, never stored. Build
    its envelope and write it to every routed sink side by side; a sink that fails gets its
    own ``deliver`` job (:mod:`receiver.delivery`), so it is retried alone.
``fetch_batch(provider, batch_id, event_id, received_at)`` (batches queue)
    Stream every row of a finished batch into the sinks (:mod:`receiver.batches`).

Every job runs under :func:`receiver.jobs.guarded`: its own deadline below arq's, Redis
errors retried, transient provider failures retried with backoff, and everything else
kept as a dead letter. A job killed mid-run is run again once its in-progress lock
expires; every sink write is idempotent, so the re-run leaves exactly one row.
"""

from __future__ import annotations

import logging
from typing import Any

from nopoll.envelope import envelope_from_response
from nopoll.exceptions import (
    ProviderError,
    ResultNotReady,
    SinkError,
    TransientProviderError,
)
from receiver.batches import LeaseLost
from receiver.delivery import deliver, queue_retries
from receiver.jobs import dead_letter, guarded, retry_or_give_up
from receiver.queue import FETCH_BATCH, FETCH_RESPONSE
from receiver.state import WorkerState
from receiver.status import TERMINAL_RESPONSE, unfinished_status

__all__ = ["deliver", "fetch_batch", "fetch_response"]

log = logging.getLogger("nopoll.worker")


@guarded(FETCH_RESPONSE, "provider", "response_id", "event_id")
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
    kwargs = {
        "provider": provider,
        "response_id": response_id,
        "event_id": event_id,
        "received_at": received_at,
        "tenant": tenant,
    }
    state: WorkerState = ctx["state"]
    dialect = state.dialects.get(provider)
    if dialect is None:
        error = f"provider {provider!r} is no longer configured"
        return await dead_letter(ctx, FETCH_RESPONSE, kwargs, error)
    try:
        body = await dialect.fetch_response(response_id)
        status = unfinished_status(body, TERMINAL_RESPONSE)
        if status is not None:
            raise ResultNotReady(provider=provider, path=f"responses/{response_id}", status=status)
        envelope = envelope_from_response(
            body, provider=provider, received_at=received_at, event_id=event_id, tenant=tenant
        )
    except TransientProviderError as exc:
        return await retry_or_give_up(ctx, FETCH_RESPONSE, kwargs, str(exc), exc.retry_after_s)
    except ProviderError as exc:
        return await dead_letter(ctx, FETCH_RESPONSE, kwargs, str(exc))

    shares = state.fanout.route([envelope])
    failures = await state.fanout.write(shares)
    if failures:
        await queue_retries(ctx, failures, shares)
    landed = ", ".join(sorted(set(shares) - set(failures)))
    failed = ", ".join(sorted(failures))
    if not failed:
        log.info("response %s/%s landed (%s) in %s", provider, response_id, envelope.status, landed)
    elif landed:
        log.info(
            "response %s/%s landed (%s) in %s; %s failed and is retried on its own",
            *(provider, response_id, envelope.status, landed, failed),
        )
    else:
        log.info(
            "response %s/%s fetched (%s); %s failed and is retried on its own",
            *(provider, response_id, envelope.status, failed),
        )
    state.metrics.jobs.labels(FETCH_RESPONSE, "ok").inc()
    return {"sinks": len(shares), "failed": sorted(failures)}


@guarded(FETCH_BATCH, "provider", "batch_id", "event_id")
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
    state: WorkerState = ctx["state"]
    metrics = state.metrics
    kwargs = {
        "provider": provider,
        "batch_id": batch_id,
        "event_id": event_id,
        "received_at": received_at,
        "event_type": event_type,
        "tenant": tenant,
    }
    dialect = state.dialects.get(provider)
    if dialect is None:
        error = f"provider {provider!r} is no longer configured"
        return await dead_letter(ctx, FETCH_BATCH, kwargs, error)
    runner = state.batch_runner
    lease = ctx.get("leases", {}).get(ctx.get("job_id"))
    try:
        outcome = await runner.run(
            dialect,
            provider=provider,
            batch_id=batch_id,
            event_id=event_id,
            received_at=received_at,
            tenant=tenant,
            lease=lease,
        )
    except LeaseLost as exc:
        # Another run may own the batch now: this one stops and leaves the job to it.
        log.warning("batch %s/%s: %s; this run stopped", provider, batch_id, exc)
        return {"lease_lost": True}
    except TransientProviderError as exc:
        metrics.batches.labels(provider, "retry").inc()
        return await retry_or_give_up(ctx, FETCH_BATCH, kwargs, str(exc), exc.retry_after_s)
    except ProviderError as exc:
        return await dead_letter(ctx, FETCH_BATCH, kwargs, str(exc))
    except SinkError as exc:
        return await retry_or_give_up(ctx, FETCH_BATCH, kwargs, str(exc))
    metrics.batches.labels(provider, "already_done" if outcome.already_done else "ok").inc()
    metrics.jobs.labels(FETCH_BATCH, "ok").inc()
    return {"rows": outcome.rows, "skipped_chunks": outcome.chunks_skipped}
