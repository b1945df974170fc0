"""The batch pipeline: provider rows → envelopes → chunks → every sink, resumable.

One job per batch (on its own arq queue, so its long timeout does not stretch the lock of
short response jobs). Rows stream in numbered chunks (default 1,000 rows); each sink has
its own small queue and writer task, so a slow sink holds up only its own queue. Every
chunk a sink commits is recorded in Redis (``nopoll:batch:<provider>:<id>``); a worker
killed mid-batch resumes after the last chunk every sink committed, and rewrites are
idempotent. A sink that keeps failing on a chunk hands that chunk to its own ``deliver``
job (retried alone, then dead-lettered) and goes on with the next. The ``batch`` summary
reaches a sink after all of that sink's rows: written by the batch job, or by the last of
the sink's handed-off deliveries.

The job's in-progress lock is a lease renewed while the job runs, so a killed worker's
batch is picked up again within ``batch.lease_s``, not after the whole job timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from arq.connections import ArqRedis
from arq.constants import in_progress_key_prefix

from receiver.config import Settings
from receiver.deadletter import DeadLetters
from receiver.envelope import Envelope, batch_summary_envelope, envelope_from_row, now_rfc3339
from receiver.fanout import FanOut
from receiver.metrics import Metrics
from receiver.providers import BatchFetch, Dialect
from receiver.queue import JOBS_QUEUE

__all__ = ["BatchOutcome", "BatchRunner", "batch_state_key", "claim_summary"]

log = logging.getLogger("nopoll.batches")
_DONE = object()


def batch_state_key(provider: str, batch_id: str) -> str:
    """The Redis hash holding one batch's progress, hand-offs and pending summaries."""
    return f"nopoll:batch:{provider}:{batch_id}"


@dataclass
class BatchOutcome:
    """What one run of a batch did."""

    rows: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    chunks_skipped: int = 0
    handed_off: dict[str, int] = field(default_factory=dict)
    already_done: bool = False


@dataclass(frozen=True, slots=True)
class _Context:
    provider: str
    batch_id: str
    event_id: str | None
    received_at: str
    tenant: str
    state_key: str


class _SinkWriter:
    """One sink's share of a batch: its own queue, in order, retried, then handed off."""

    def __init__(self, runner: BatchRunner, name: str, committed: int, state_key: str) -> None:
        self.runner = runner
        self.name = name
        self.committed = committed
        self.state_key = state_key
        self.queue: asyncio.Queue[Any] = asyncio.Queue(
            maxsize=runner.settings.batch.sink_queue_chunks
        )
        self.handed_off = 0

    async def run(self) -> None:
        while True:
            item = await self.queue.get()
            if item is _DONE:
                return
            number, envelopes = item
            if number <= self.committed:
                continue
            if envelopes:
                await self._write(number, envelopes)
            await self.runner.redis.hset(self.state_key, f"c:{self.name}", number)  # type: ignore[misc]
            self.committed = number

    async def _write(self, number: int, envelopes: list[Envelope]) -> None:
        sink = self.runner.fanout.sinks[self.name]
        attempts = self.runner.settings.batch.sink_attempts
        retry = self.runner.settings.sink_retry
        for attempt in range(1, attempts + 1):
            try:
                await sink.write_part(number, envelopes)
                return
            except Exception as exc:
                if attempt == attempts:
                    log.warning(
                        "sink %s failed chunk %d of %s %d times (%s); retrying it on its own",
                        self.name,
                        number,
                        self.state_key,
                        attempts,
                        exc,
                    )
                    break
                await asyncio.sleep(min(retry.delay(attempt), 5.0))
        self.handed_off += 1
        await self.runner.redis.hincrby(self.state_key, f"h:{self.name}", 1)  # type: ignore[misc]
        await self.runner.enqueue_delivery(self.name, envelopes, self.state_key, part=number)


class BatchRunner:
    """Runs the pipeline for one batch (used by the arq job and ``nopoll fetch-batch``)."""

    def __init__(
        self,
        settings: Settings,
        *,
        redis: ArqRedis,
        fanout: FanOut,
        dead_letters: DeadLetters,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.fanout = fanout
        self.dead_letters = dead_letters
        self.metrics = metrics

    async def enqueue_delivery(
        self, sink: str, envelopes: list[Envelope], state_key: str | None, part: int | None = None
    ) -> None:
        """Queue a ``deliver`` job for one sink (retried on its own, then dead-lettered)."""
        await self.redis.enqueue_job(
            "deliver",
            sink=sink,
            envelopes=[e.to_dict() for e in envelopes],
            batch_state=state_key,
            part=part,
            _job_id=f"deliver:{sink}:{uuid.uuid4().hex}",
            _queue_name=JOBS_QUEUE,
            _defer_by=self.settings.sink_retry.delay(1),
            _job_try=2,
        )

    async def _renew_lease(self, job_id: str) -> None:
        lease_ms = int(self.settings.batch.lease_s * 1000)
        while True:
            await self.redis.pexpire(in_progress_key_prefix + job_id, lease_ms)
            await asyncio.sleep(self.settings.batch.lease_s / 3)

    async def run(
        self,
        dialect: Dialect,
        *,
        provider: str,
        batch_id: str,
        event_id: str | None,
        received_at: str,
        tenant: str = "default",
        job_id: str | None = None,
        force: bool = False,
        on_progress: Callable[[int], None] | None = None,
    ) -> BatchOutcome:
        """Deliver every row of the batch, then its summary, to every routed sink."""
        key = batch_state_key(provider, batch_id)
        raw_state = await self.redis.hgetall(key)  # type: ignore[misc]
        state = {k.decode(): v.decode() for k, v in raw_state.items()}
        outcome = BatchOutcome()
        if state.get("done") and not force:
            outcome.already_done = True
            return outcome
        if force:
            await self.redis.delete(key)
            state = {}
        sinks = list(self.fanout.sinks)
        committed = {s: int(state.get(f"c:{s}", -1)) for s in sinks}
        fetch = BatchFetch(
            batch_id=batch_id,
            chunk_size=self.settings.batch.chunk_size,
            skip_before=min(committed.values(), default=-1) + 1,
        )
        outcome.chunks_skipped = fetch.skip_before
        writers = {s: _SinkWriter(self, s, committed[s], key) for s in sinks}
        tasks = [asyncio.create_task(w.run(), name=f"batch-sink-{s}") for s, w in writers.items()]
        lease = asyncio.create_task(self._renew_lease(job_id)) if job_id else None
        started = time.monotonic()
        context = _Context(provider, batch_id, event_id, received_at, tenant, key)
        try:
            try:
                await self._produce(dialect, fetch, context, writers, tasks, outcome, on_progress)
            except Exception:
                # Keep what was fetched already: the writers commit the queued chunks first.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._drain(writers, tasks), 60)
                raise
            await self._drain(writers, tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if lease is not None:
                lease.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await lease

        summary = batch_summary_envelope(
            fetch.batch,
            provider=provider,
            batch_id=batch_id,
            received_at=received_at,
            event_id=event_id,
            counts=await self._all_counts(key, outcome),
            tenant=tenant,
        )
        await self._deliver_summary(key, summary)
        outcome.handed_off = {s: w.handed_off for s, w in writers.items() if w.handed_off}
        await self.redis.hset(key, "done", "1")  # type: ignore[misc]
        await self.redis.expire(key, self.settings.dedupe_ttl_s)
        log.info(
            "batch %s/%s: %d rows delivered in %.1fs %s",
            provider,
            batch_id,
            outcome.rows,
            time.monotonic() - started,
            dict(outcome.by_status),
        )
        return outcome

    async def _produce(
        self,
        dialect: Dialect,
        fetch: BatchFetch,
        ctx: _Context,
        writers: dict[str, _SinkWriter],
        tasks: list[asyncio.Task[None]],
        outcome: BatchOutcome,
        on_progress: Callable[[int], None] | None,
    ) -> None:
        rows_metric = self.metrics.batch_rows.labels(ctx.provider)
        started = last_log = time.monotonic()
        async for number, rows in dialect.batch_chunks(fetch):
            fetched_at = now_rfc3339()
            envelopes = [
                envelope_from_row(
                    row,
                    provider=ctx.provider,
                    batch_id=ctx.batch_id,
                    received_at=ctx.received_at,
                    event_id=ctx.event_id,
                    tenant=ctx.tenant,
                    fetched_at=fetched_at,
                )
                for row in rows
            ]
            outcome.rows += len(envelopes)
            chunk_counts = Counter(e.status for e in envelopes)
            outcome.by_status.update(chunk_counts)
            # Per-chunk counts survive a restart, so the summary also counts skipped chunks.
            await self.redis.hset(  # type: ignore[misc]
                ctx.state_key, f"k:{number}", orjson.dumps(chunk_counts).decode()
            )
            rows_metric.inc(len(envelopes))
            shares = self.fanout.route(envelopes)
            for name, writer in writers.items():
                await _put(writer.queue, (number, shares.get(name, [])), tasks)
            if on_progress is not None:
                on_progress(len(envelopes))
            now = time.monotonic()
            if now - last_log >= 5:
                last_log = now
                rate = outcome.rows / (now - started)
                log.info(
                    "batch %s/%s: %d rows so far (%.0f rows/s)",
                    ctx.provider,
                    ctx.batch_id,
                    outcome.rows,
                    rate,
                )

    async def _all_counts(self, key: str, outcome: BatchOutcome) -> dict[str, int]:
        """Rows by status over every chunk of the batch, this run's and earlier runs'."""
        raw = await self.redis.hgetall(key)  # type: ignore[misc]
        total: Counter[str] = Counter()
        for name, value in raw.items():
            if name.startswith(b"k:"):
                total.update(orjson.loads(value))
        return dict(total) if total else dict(outcome.by_status)

    async def _drain(
        self, writers: dict[str, _SinkWriter], tasks: list[asyncio.Task[None]]
    ) -> None:
        for writer in writers.values():
            await _put(writer.queue, _DONE, tasks)
        await asyncio.gather(*tasks)

    async def _deliver_summary(self, key: str, summary: Envelope) -> None:
        for name in self.fanout.route([summary]):
            # Park the summary; whoever sees the sink's hand-off count at zero writes it.
            await self.redis.hset(key, f"s:{name}", orjson.dumps(summary.to_dict()).decode())  # type: ignore[misc]
            pending = int(await self.redis.hget(key, f"h:{name}") or 0)  # type: ignore[misc]
            if pending <= 0:
                await claim_summary(self, key, name)


async def claim_summary(runner: BatchRunner, key: str, sink: str) -> None:
    """Write a parked summary to ``sink`` once (GET+DEL in one transaction claims it)."""
    async with runner.redis.pipeline(transaction=True) as pipe:
        pipe.hget(key, f"s:{sink}")
        pipe.hdel(key, f"s:{sink}")
        raw, _ = await pipe.execute()
    if raw is None:
        return
    summary = Envelope.from_dict(orjson.loads(raw))
    try:
        await runner.fanout.sinks[sink].write([summary])
    except Exception as exc:
        log.warning("sink %s failed the batch summary (%s); retrying it on its own", sink, exc)
        await runner.enqueue_delivery(sink, [summary], None)


async def _put(queue: asyncio.Queue[Any], item: Any, tasks: list[asyncio.Task[None]]) -> None:
    """Put into a sink's queue, but fail fast if a sink writer died."""
    while True:
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        try:
            await asyncio.wait_for(queue.put(item), 1.0)
            return
        except TimeoutError:
            continue
