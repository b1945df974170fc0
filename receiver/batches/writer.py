"""One sink's share of a batch: its own queue of chunks, written in order, retried, then
handed to a ``deliver`` job of its own; every chunk's outcome recorded in the batch's
:class:`~receiver.batches.progress.BatchState` in one atomic step."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkRejected, SinkRowsRejected
from receiver.batches.progress import BatchState
from receiver.config.settings import Settings
from receiver.fanout.fanout import FanOut
from receiver.metrics import Metrics
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import DELIVER
from receiver.queue.jobs import DeliverJob, rejection_text
from receiver.tracing import span

__all__ = ["DONE", "SinkWriter"]

log = logging.getLogger("nopoll.batches")

DONE = object()
"""Put in a writer's queue after the last chunk."""

_IN_JOB_MAX_S = 5.0
"""A chunk's waits inside the batch job stay short: the stream behind it is waiting."""


class SinkWriter:
    """One sink's share of a batch: its own queue, in order, retried, then handed off."""

    def __init__(
        self,
        name: str,
        committed: int,
        state: BatchState,
        *,
        settings: Settings,
        fanout: FanOut,
        dead_letters: DeadLetters,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.fanout = fanout
        self.dead_letters = dead_letters
        self.metrics = metrics
        self.name = name
        self.committed = committed
        self.state = state
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=settings.batch.sink_queue_chunks)
        self.handed_off = 0
        self.rows = 0
        """Rows this run wrote (what the batch's journey shows)."""
        self.chunks = 0

    async def run(self) -> None:
        while True:
            item = await self.queue.get()
            if item is DONE:
                return
            number, envelopes, ticket = item
            try:
                if number <= self.committed:
                    continue
                if envelopes:
                    await self._write(number, envelopes)
                else:
                    await self.state.commit(self.name, number)
                self.committed = number
            finally:
                ticket.done()

    async def _write(self, number: int, envelopes: list[Envelope]) -> None:
        attributes = {"nopoll.sink": self.name, "nopoll.chunk": number}
        with span("batch chunk", attributes):  # a child of the batch's span
            await self._write_chunk(number, envelopes)

    async def _write_chunk(self, number: int, envelopes: list[Envelope]) -> None:
        sink = self.fanout.sinks[self.name]
        settings = self.settings
        attempts = settings.batch.sink_attempts
        backoff = settings.sink_retry.backoff(max_s=_IN_JOB_MAX_S)
        for attempt in range(1, attempts + 1):
            try:
                await sink.write_part(number, envelopes)
            except SinkRowsRejected as exc:
                # The other rows are written; the refused ones become a dead letter and the
                # chunk stays pending, so this sink's summary waits for their replay.
                refused = [e for e in envelopes if e.key in exc.rejected]
                await self._dead_letter(number, refused, None, rejection_text(exc))
                await self.state.commit(self.name, number, pending=True)
                return
            except SinkRejected as exc:
                await self._dead_letter(number, envelopes, number, str(exc))
                await self.state.commit(self.name, number, pending=True)
                return
            except Exception as exc:
                if attempt < attempts:
                    await asyncio.sleep(backoff.delay(attempt))
                    continue
                log.warning(
                    "sink %s failed chunk %d of %s %d times (%s); retrying it on its own",
                    self.name,
                    number,
                    self.state.key,
                    attempts,
                    exc,
                )
                self.handed_off += 1
                fp = self.fanout.fingerprints.get(self.name)
                job = DeliverJob.of(
                    self.name, envelopes, self.state.key, number, number, fp=fp
                ).handoff(defer_s=settings.sink_retry.delay(1))
                await self.state.commit(self.name, number, handoff=job)
                return
            await self.state.commit(self.name, number)
            self.rows += len(envelopes)
            self.chunks += 1
            return

    async def _dead_letter(
        self, number: int, envelopes: list[Envelope], part: int | None, error: str
    ) -> None:
        letter = await self.dead_letters.add(
            sink=self.name,
            provider=envelopes[0].provider if envelopes else "",
            keys=[e.key for e in envelopes],
            attempts=1,
            error=error,
            function=DELIVER,
            kwargs=DeliverJob.of(
                self.name,
                envelopes,
                self.state.key,
                part,
                number,
                fp=self.fanout.fingerprints.get(self.name),
            ).to_kwargs(),
        )
        self.metrics.dead_letters.labels(self.name).inc()
        log.error(
            "dead letter %s: %s refused %d row(s): %s", letter.id, self.name, len(envelopes), error
        )
