"""The batch pipeline: provider rows → envelopes → chunks → every sink, resumable.

One job per batch, on its own arq queue. Rows stream in numbered chunks, each sink with
its own small queue and writer task; every committed chunk is recorded in
:class:`~receiver.batches.progress.BatchState`, so a killed worker's batch resumes after
the last chunk every sink committed (from the first row without ``stable_chunks``). A
chunk a sink keeps failing goes to its own ``deliver`` job. A batch not final yet raises
:class:`~nopoll.exceptions.ResultNotReady`; a run that cannot renew its lease stops.

See docs/batches.md (streaming, chunks and resumption).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from nopoll.envelope import Envelope, batch_summary_envelope, envelope_from_row, now_rfc3339
from nopoll.exceptions import NopollError, ResultNotReady
from receiver.aio import settle_cancelled
from receiver.batches.budget import ChunkBudget, ChunkTicket
from receiver.batches.progress import BatchState, ChunkBounds, batch_state_key
from receiver.batches.writer import DONE, SinkWriter
from receiver.config.accounts import DEFAULT_TENANT, scoped
from receiver.config.settings import Settings
from receiver.fanout.fanout import FanOut
from receiver.journey.store import JourneyStore
from receiver.metrics import Metrics
from receiver.providers import BatchFetch, Dialect
from receiver.queue.deadletter import DeadLetters
from receiver.tracing import span

__all__ = ["BatchOutcome", "BatchRunner", "Lease", "LeaseLost", "batch_state_key"]

log = logging.getLogger("nopoll.batches")


class Lease(Protocol):
    """The batch job's hold on its in-progress lock (see :mod:`receiver.worker.process`)."""

    lost: bool

    async def renew(self, ttl_ms: int) -> bool:
        """Extend the lock to ``ttl_ms`` from now; False when it is no longer ours."""
        ...


class LeaseLost(NopollError):
    """The batch run could not keep its lease; it stopped so that no second run overlaps."""


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
    state: BatchState


class BatchRunner:
    """Runs the pipeline for one batch (used by the arq job and ``nopoll fetch-batch``)."""

    def __init__(
        self,
        settings: Settings,
        *,
        redis: Redis,
        fanout: FanOut,
        dead_letters: DeadLetters,
        metrics: Metrics,
        dead_after_s: float,
        journey: JourneyStore | None = None,
    ) -> None:
        """``dead_after_s`` is the liveness bound: a worker silent that long is taken for
        dead and its batch passes to another (:mod:`receiver.worker.liveness`). A
        ``journey`` store gets the run's events: the rows fetched, then one per sink."""
        self.settings = settings
        self.redis = redis
        self.fanout = fanout
        self.dead_letters = dead_letters
        self.metrics = metrics
        self.dead_after_s = dead_after_s
        self.journey = journey
        self.budget = ChunkBudget(settings.batch.inflight_bytes)
        """Bytes of chunks in flight, shared by every batch this runner runs at once."""

    def state(self, provider: str, batch_id: str) -> BatchState:
        """A batch's progress; ``provider`` is scoped by tenant (see
        :func:`~receiver.config.accounts.scoped`)."""
        return BatchState.of(
            self.redis,
            provider,
            batch_id,
            ttl_s=self.settings.dedupe_ttl_s,
            job_expiry_ms=self.settings.job_expiry_s * 1000,
        )

    async def _hold(self, lease: Lease) -> None:
        """Renew the lease every third of ``batch.lease_s`` (at most every quarter of the
        liveness bound); return (which stops the run) when it is taken over, or when it
        could not be renewed for 80% of ``lease_s`` or half the liveness bound, whichever
        is shorter: before the lock can expire, or this worker be taken for dead
        (:mod:`receiver.worker.liveness`), and the batch pass to another worker."""
        lease_s = self.settings.batch.lease_s
        ttl_ms = int(lease_s * 1000)
        every_s = min(lease_s / 3, self.dead_after_s / 4)
        give_up_s = min(0.8 * lease_s, self.dead_after_s / 2)
        last_ok = time.monotonic()
        while True:
            try:
                left_s = give_up_s - (time.monotonic() - last_ok)
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the
                # cancel that ends this holder when it races the renew's answer
                async with asyncio.timeout(max(0.1, left_s)):
                    renewed = await lease.renew(ttl_ms)
                if not renewed:
                    lease.lost = True
                    log.warning("batch lease taken over by another run")
                    return
                last_ok = time.monotonic()
                await asyncio.sleep(every_s)
            except (RedisError, OSError, TimeoutError) as exc:
                if time.monotonic() - last_ok >= give_up_s:
                    lease.lost = True
                    log.warning(
                        "batch lease not renewed for %.0f s (%s)", give_up_s, type(exc).__name__
                    )
                    return
                await asyncio.sleep(min(1.0, lease_s / 10))

    async def run(
        self,
        dialect: Dialect,
        *,
        provider: str,
        batch_id: str,
        event_id: str | None,
        received_at: str,
        tenant: str = DEFAULT_TENANT,
        lease: Lease | None = None,
        force: bool = False,
        on_progress: Callable[[int], None] | None = None,
    ) -> BatchOutcome:
        """Deliver every row of the batch, then its summary, to every routed sink. With a
        ``lease``, the run stops (:class:`LeaseLost`) when the lease cannot be kept."""
        state = self.state(scoped(provider, tenant), batch_id)
        context = _Context(provider, batch_id, event_id, received_at, tenant, state)
        run = self._run(dialect, context, force, on_progress)
        if lease is None:
            return await run
        work = asyncio.create_task(run)
        holder = asyncio.create_task(self._hold(lease))
        try:
            await asyncio.wait([work, holder], return_when=asyncio.FIRST_COMPLETED)
        finally:
            holder.cancel()
            await stop_task(work)
            await asyncio.gather(holder, work, return_exceptions=True)
        if work.cancelled():  # the holder returned first: the lease is lost
            raise LeaseLost("lease lost")
        return work.result()

    async def _run(
        self,
        dialect: Dialect,
        ctx: _Context,
        force: bool,
        on_progress: Callable[[int], None] | None,
    ) -> BatchOutcome:
        attributes = {"nopoll.provider": ctx.provider, "nopoll.batch_id": ctx.batch_id}
        with span("batch", attributes):  # the parent of its chunks' spans
            sinks = list(self.fanout.sinks)
            outcome = BatchOutcome()
            if force:
                await ctx.state.reset(sinks)
            progress = await ctx.state.load(sinks)
            if progress.done:
                outcome.already_done = True
                return outcome
            batch = self.settings.batch
            bounds = await ctx.state.begin(ChunkBounds(batch.chunk_size, batch.chunk_bytes))
            # rows in no stable order: a chunk number names other rows this time, skip none
            committed = progress.committed if dialect.stable_chunks else dict.fromkeys(sinks, -1)
            fetch = BatchFetch(
                batch_id=ctx.batch_id,
                chunk_size=bounds.rows,
                chunk_bytes=bounds.bytes,
                skip_before=min(committed.values(), default=-1) + 1,
            )
            outcome.chunks_skipped = fetch.skip_before
            writers = {
                s: SinkWriter(
                    s,
                    committed[s],
                    ctx.state,
                    settings=self.settings,
                    fanout=self.fanout,
                    dead_letters=self.dead_letters,
                    metrics=self.metrics,
                )
                for s in sinks
            }
            started = time.monotonic()
            await self._stream(dialect, fetch, ctx, writers, outcome, on_progress)
            await self._summarize(dialect, fetch, ctx, outcome)
            outcome.handed_off = {s: w.handed_off for s, w in writers.items() if w.handed_off}
            await ctx.state.finish()
            await self._trail(ctx, outcome, writers)
            log.info(
                "batch %s/%s: %d rows delivered in %.1f s (%s)",
                ctx.provider,
                ctx.batch_id,
                outcome.rows,
                time.monotonic() - started,
                ", ".join(f"{n} {status}" for status, n in sorted(outcome.by_status.items())),
            )
            return outcome

    async def _trail(
        self, ctx: _Context, outcome: BatchOutcome, writers: dict[str, SinkWriter]
    ) -> None:
        """The run on the batch's journey: one event for the rows, one per sink (never one
        per row or chunk: a 100,000-row batch is still a short trail)."""
        if self.journey is None:
            return
        by_status = dict(outcome.by_status)
        await self.journey.record(
            ctx.provider,
            ctx.batch_id,
            "fetch",
            ctx.tenant,
            kind="batch",
            rows=outcome.rows,
            rows_by_status=by_status,
            chunks_skipped=outcome.chunks_skipped,
        )
        for name, writer in writers.items():
            await self.journey.record(
                ctx.provider,
                ctx.batch_id,
                "sink",
                ctx.tenant,
                sink=name,
                rows=writer.rows,
                chunks=writer.chunks,
                handed_off=writer.handed_off,
            )

    async def _stream(
        self,
        dialect: Dialect,
        fetch: BatchFetch,
        ctx: _Context,
        writers: dict[str, SinkWriter],
        outcome: BatchOutcome,
        on_progress: Callable[[int], None] | None,
    ) -> None:
        """Every row into the sink writers' queues, then wait until they wrote them all."""
        tasks = [asyncio.create_task(w.run(), name=f"batch-sink-{s}") for s, w in writers.items()]
        tickets: deque[ChunkTicket] = deque()
        try:
            try:
                await self._produce(
                    dialect, fetch, ctx, writers, tasks, tickets, outcome, on_progress
                )
            except Exception as exc:
                if _stopping():
                    # A shutdown's cancel that surfaced as another error (a timeout racing
                    # it, a transport that wraps it): stop now, as a cancel; the chunks not
                    # committed yet are fetched again by the next run.
                    raise asyncio.CancelledError from exc
                # Keep what was fetched already: the writers commit the queued chunks first.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(60):
                        await self._drain(writers, tasks)
                raise
            await self._drain(writers, tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for ticket in tickets:  # chunks the stopped writers never got to
                ticket.close()

    async def _summarize(
        self, dialect: Dialect, fetch: BatchFetch, ctx: _Context, outcome: BatchOutcome
    ) -> None:
        """The batch summary to every routed sink, after all of that sink's rows."""
        summary = batch_summary_envelope(
            fetch.batch,
            provider=ctx.provider,
            batch_id=ctx.batch_id,
            received_at=ctx.received_at,
            event_id=ctx.event_id,
            counts=dict(await ctx.state.counts() or outcome.by_status),
            tenant=ctx.tenant,
            facts=dialect.batch_facts(fetch.batch),
        )
        for name in self.fanout.route([summary]):
            await self._deliver_summary(ctx.state, name, summary)

    async def _produce(
        self,
        dialect: Dialect,
        fetch: BatchFetch,
        ctx: _Context,
        writers: dict[str, SinkWriter],
        tasks: list[asyncio.Task[None]],
        tickets: deque[ChunkTicket],
        outcome: BatchOutcome,
        on_progress: Callable[[int], None] | None,
    ) -> None:
        rows_metric = self.metrics.batch_rows.labels(ctx.provider)
        started = last_log = time.monotonic()
        counted = False
        chunks = dialect.batch_chunks(fetch)
        while True:
            # Room for a whole chunk before the dialect reads and parses the next one; the
            # ticket then holds what the chunk really is (a chunk of per-row GETs, whose
            # size is unknown, counts as a whole one).
            await self.budget.acquire(fetch.chunk_bytes)
            try:
                number, rows = await anext(chunks)
            except StopAsyncIteration:
                self.budget.release(fetch.chunk_bytes)
                break
            except BaseException:
                self.budget.release(fetch.chunk_bytes)
                raise
            size = fetch.last_chunk_bytes or fetch.chunk_bytes
            self.budget.resize(fetch.chunk_bytes, size)
            ticket = ChunkTicket(self.budget, size, len(writers))
            tickets.append(ticket)
            while tickets and not tickets[0].open:
                tickets.popleft()
            self._check_finished(dialect, fetch, ctx, partial=True)
            if not counted:
                counted = True
                if (total := _row_count(dialect, fetch.batch)) is not None:
                    await ctx.state.record_rows(total)
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
                    fields=dialect.normalize(row.body),
                )
                for row in rows
            ]
            outcome.rows += len(envelopes)
            chunk_counts = Counter(e.status for e in envelopes)
            outcome.by_status.update(chunk_counts)
            # Per-chunk counts survive a restart, so the summary also counts skipped chunks.
            await ctx.state.record_counts(number, chunk_counts)
            rows_metric.inc(len(envelopes))
            shares = self.fanout.route(envelopes)
            for name, writer in writers.items():
                await _put(writer.queue, (number, shares.get(name, []), ticket), tasks)
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
        self._check_finished(dialect, fetch, ctx, partial=False)

    def _check_finished(
        self, dialect: Dialect, fetch: BatchFetch, ctx: _Context, *, partial: bool
    ) -> None:
        """A batch that is not terminal yet is retried later, never summarized. While the
        object is still streaming (Sail's inline results: it is complete only once they
        are read) there is no verdict yet."""
        if partial and not fetch.batch:
            return
        status = dialect.batch_pending(fetch.batch)
        if status is not None:
            raise ResultNotReady(
                provider=ctx.provider, path=f"batches/{ctx.batch_id}", status=status
            )

    async def _deliver_summary(self, state: BatchState, sink: str, summary: Envelope) -> None:
        """Write the summary now when every row of the sink is in (only this run adds
        pending chunks, so the check cannot go stale); else park it until the last pending
        chunk settles. A failed write parks it too, as a delivery of its own. A worker
        killed before this point runs the batch again: every chunk is skipped and the
        summary comes here again."""
        if await state.pending(sink) == 0:
            try:
                await self.fanout.sinks[sink].write([summary])
                return
            except Exception as exc:
                log.warning(
                    "sink %s failed the batch summary (%s); retrying it on its own", sink, exc
                )
        await state.park_summary(sink, summary.to_dict(), fp=self.fanout.fingerprints.get(sink))

    async def _drain(self, writers: dict[str, SinkWriter], tasks: list[asyncio.Task[None]]) -> None:
        for writer in writers.values():
            await _put(writer.queue, DONE, tasks)
        await asyncio.gather(*tasks)


_STOP_WAIT_S = 120.0
"""How long :func:`stop_task` waits for a run it cancelled."""


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it is done, sending the cancel again where Python 3.11
    lost it (:func:`~receiver.queue._arq.settle_cancelled`): a batch whose lease is lost
    must not run on without it. Gives up waiting after two minutes; the task is then still
    cancelled."""
    await settle_cancelled([task], _STOP_WAIT_S)


def _stopping() -> bool:
    """This task has been asked to stop (cancelled), whatever it raised since."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _row_count(dialect: Dialect, batch: dict[str, Any] | None) -> int | None:
    """The batch's request count from its dialect's facts: ``total``; with no ``total``,
    the sum of its counts (Anthropic's ``processing``, ``succeeded``, ... add up to it)."""
    if not batch:
        return None
    counts = dialect.batch_facts(batch).request_counts
    total = counts.get("total")
    if total is None and counts:
        total = sum(counts.values())
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None


async def _put(queue: asyncio.Queue[Any], item: Any, tasks: list[asyncio.Task[None]]) -> None:
    """Put into a sink's queue, but fail fast if a sink writer died."""
    while True:
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        try:
            async with asyncio.timeout(1.0):
                await queue.put(item)
            return
        except TimeoutError:
            continue
