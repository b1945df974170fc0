"""The ``deliver`` job: write envelopes to one sink, retried alone, then a dead letter.

A delivery is queued when a sink fails while the others succeed (a response's fan-out),
when a batch chunk keeps failing in the batch job (a hand-off), for a batch summary once
its sink has every row, and by ``nopoll dlq replay``.

A delivery of a batch chunk (``batch_state`` and ``settle`` set) settles that chunk only
when it succeeds; a dead-lettered one leaves the chunk pending, so the batch summary stays
parked until the dead letter is replayed successfully.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkError, SinkRejected, SinkRowsRejected
from receiver.batches.progress import BatchState
from receiver.journey.store import envelope_ids
from receiver.logs import Throttle
from receiver.queue.enqueue import put_job
from receiver.queue.jobs import DELIVER, DeliverJob, rejection_text
from receiver.worker.liveness import ServedAccounts
from receiver.worker.retry import dead_letter, hand_over, handles, retry_or_give_up
from receiver.worker.state import WorkerState

__all__ = ["batch_state_for", "deliver", "queue_retries"]

log = logging.getLogger("nopoll.worker")


async def queue_retries(
    ctx: dict[str, Any],
    failures: Mapping[str, SinkError],
    shares: Mapping[str, Sequence[Envelope]],
) -> None:
    """After a fan-out: each failed sink gets its own delivery (retried alone); a sink that
    refused the data itself gets a dead letter at once (a retry cannot change its mind)."""
    state: WorkerState = ctx["state"]
    settings = state.settings
    for name, error in failures.items():
        share = list(shares[name])
        fp = state.fanout.fingerprints.get(name)
        if isinstance(error, SinkRowsRejected):
            refused = [e for e in share if e.key in error.rejected]
            kwargs = DeliverJob.of(name, refused, fp=fp).to_kwargs()
            await dead_letter(ctx, DELIVER, kwargs, rejection_text(error))
            continue
        if isinstance(error, SinkRejected):
            kwargs = DeliverJob.of(name, share, fp=fp).to_kwargs()
            await dead_letter(ctx, DELIVER, kwargs, str(error))
            continue
        log.warning("sink %s failed, retrying on its own: %s", name, error)
        job = DeliverJob.of(name, share, fp=fp).handoff(defer_s=settings.sink_retry.delay(1))
        await put_job(state.redis, job, expiry_ms=settings.job_expiry_s * 1000)


_DIFFERS = Throttle(log, every_s=60.0)
"""A stray worker's hand-backs: one line per sink a minute."""


def _say_differs(state: WorkerState, sink: str, job_id: object) -> None:
    """Count a delivery left for another worker because this one's sink of that name is
    configured otherwise, and say so (one line per sink a minute)."""
    state.metrics.count_job(DELIVER, "handed_back")
    _DIFFERS.log(
        logging.WARNING,
        sink,
        "sink %s here differs from the one delivery %s was queued for (another URL, table or "
        "key: is this worker started with another config?): left to a worker whose sink %s "
        "is that one",
        sink,
        job_id,
        sink,
    )


def _keys(envelopes: list[dict[str, Any]]) -> str:
    keys = [str(e.get("key")) for e in envelopes[:3]]
    return ", ".join(keys) + (f" (+{len(envelopes) - 3} more)" if len(envelopes) > 3 else "")


def batch_state_for(state: WorkerState, key: str) -> BatchState:
    """The :class:`BatchState` behind a delivery's ``batch_state`` key."""
    return BatchState(
        state.redis,
        key,
        ttl_s=state.settings.dedupe_ttl_s,
        job_expiry_ms=state.settings.job_expiry_s * 1000,
    )


@handles(DELIVER, "sink", "batch_state")
async def deliver(ctx: dict[str, Any], **payload: Any) -> dict[str, Any]:
    """Write envelopes to one sink (a :class:`~receiver.queue.jobs.DeliverJob`'s kwargs);
    retry with backoff, then keep as a dead letter.

    ``part`` is the chunk number S3 names its part file by (None: a plain write).
    ``batch_state`` and ``settle`` name the batch and the pending chunk this delivery
    settles when it succeeds.
    """
    job = DeliverJob.from_kwargs(payload)
    sink, envelopes, batch_state, part = job.sink, job.envelopes, job.batch_state, job.part
    settle = job.settle
    kwargs = job.to_kwargs()
    state: WorkerState = ctx["state"]
    target = state.fanout.sinks.get(sink)
    if target is None:
        if await ServedAccounts(state.redis).serves_sink(sink):
            return await hand_over(ctx, DELIVER)  # another live worker has this sink
        return await dead_letter(ctx, DELIVER, kwargs, f"sink {sink!r} is no longer configured")
    if job.fp is not None and job.fp != state.fanout.fingerprints.get(sink):
        if await ServedAccounts(state.redis).serves_sink(sink, job.fp):
            _say_differs(state, sink, ctx.get("job_id"))
            return await hand_over(ctx, DELIVER)  # to a worker whose sink is the one queued for
        log.warning(
            "sink %s here differs from the one this delivery was queued for, and no live "
            "worker has that one (its config changed): writing it to this one",
            sink,
        )
    batch = [Envelope.from_dict(e) for e in envelopes]
    try:
        if part is None:
            await target.write(batch)
        else:
            await target.write_part(part, batch)
    except SinkRowsRejected as exc:
        # The others are written; only the refused rows are kept, and the chunk stays
        # pending (its summary waits) until a replay of them succeeds.
        refused = [e for e in envelopes if str(e.get("key")) in exc.rejected]
        letter = DeliverJob(sink, refused, batch_state, None, settle).to_kwargs()
        return await dead_letter(ctx, DELIVER, letter, rejection_text(exc))
    except SinkRejected as exc:
        return await dead_letter(ctx, DELIVER, kwargs, str(exc))
    except SinkError as exc:
        return await retry_or_give_up(ctx, DELIVER, kwargs, str(exc), exc.retry_after_s)
    if batch_state is not None and settle is not None:
        await batch_state_for(state, batch_state).settle(sink, settle)
    for provider, tenant, object_id in envelope_ids(envelopes):
        await state.trail(
            provider, object_id, "sink", tenant, sink=sink, rows=len(envelopes), retry=True
        )
    log.info("sink %s took %d result(s) on a retry: %s", sink, len(envelopes), _keys(envelopes))
    state.metrics.count_job(DELIVER, "ok")
    return {"rows": len(envelopes)}
