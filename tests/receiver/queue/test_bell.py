"""The queue's bell (receiver.queue._arq.WAKE_KEY): an idle worker does not wait for its
next poll. Each worker here polls every 5 s and waits at most 5 s on the bell, so only a
ring (or the due time of a deferred job) can make it take a job sooner; against a real
Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sized
from typing import Any

from receiver.queue._arq import Retry, SeamWorker, arq_pool, func, job_deserializer, job_serializer
from receiver.queue.enqueue import put_job
from receiver.queue.jobs import FETCH_RESPONSE, QueuedJob, queue_for
from receiver.redis import RedisConnector

QUEUE = queue_for(FETCH_RESPONSE)
SLOW_S = 5.0  # the worker's poll and longest idle wait: what a job waits without a ring


class Bell(SeamWorker):
    async def give_up(self, job: Any) -> None:
        raise AssertionError(f"nothing is given up here: {job}")


@contextlib.asynccontextmanager
async def idle_worker(
    redis_url: str, job: Any, idle_wait_s: float | None, *, max_jobs: int = 10
) -> AsyncIterator[None]:
    worker = Bell(
        [func(job, name=FETCH_RESPONSE)],
        redis_pool=arq_pool(RedisConnector.from_url(redis_url), queue=QUEUE),
        queue_name=QUEUE,
        poll_delay=SLOW_S,
        idle_wait_s=idle_wait_s,
        handle_signals=False,
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        keep_result=0,
        max_jobs=max_jobs,
    )
    task = asyncio.create_task(worker.async_run())
    try:
        await asyncio.sleep(0.5)  # it found the queue empty and waits
        yield
    finally:
        # as nopoll stops its workers (receiver.queue._arq.wait_stopped): Python 3.11 can
        # lose a cancel that races the timeout of the worker's read of the bell, so it is
        # sent again until the task ends (bounded)
        for _ in range(100):
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                break
        assert task.done(), "the worker did not stop"
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await worker.close()


async def until(runs: Sized, count: int, *, tries: int) -> None:
    """Until ``runs`` holds ``count`` runs, looking every 20 ms at most ``tries`` times."""
    for _ in range(tries):
        if len(runs) >= count:
            return
        await asyncio.sleep(0.02)


async def queue_one(redis_url: str, job_id: str) -> float:
    client = RedisConnector.from_url(redis_url).client("queue")
    try:
        assert await put_job(client, QueuedJob(FETCH_RESPONSE, job_id, {}), expiry_ms=60_000)
    finally:
        await client.aclose()
    return time.monotonic()


async def test_a_queued_job_rings_and_an_idle_worker_runs_it_at_once(redis_url: str) -> None:
    ran: list[float] = []

    async def job(ctx: dict[str, Any], **kwargs: Any) -> None:
        ran.append(time.monotonic())

    async with idle_worker(redis_url, job, idle_wait_s=SLOW_S):
        queued = [await queue_one(redis_url, f"bell{i}") for i in range(3)]
        await until(ran, 3, tries=100)
    waits = [r - q for q, r in zip(queued, ran, strict=False)]
    assert len(ran) == 3 and max(waits) < SLOW_S / 5, waits  # not at the next poll


async def test_a_deferred_retry_runs_when_due_not_at_the_next_poll(redis_url: str) -> None:
    tries: list[float] = []

    async def job(ctx: dict[str, Any], **kwargs: Any) -> None:
        tries.append(time.monotonic())
        if len(tries) == 1:
            raise Retry(defer=0.5)

    async with idle_worker(redis_url, job, idle_wait_s=SLOW_S):
        await queue_one(redis_url, "deferred")
        await until(tries, 2, tries=150)
    assert len(tries) == 2, tries
    assert 0.45 <= tries[1] - tries[0] < SLOW_S / 2, tries


async def test_without_a_bell_the_worker_polls(redis_url: str) -> None:
    ran: list[float] = []

    async def job(ctx: dict[str, Any], **kwargs: Any) -> None:
        ran.append(time.monotonic())

    async with idle_worker(redis_url, job, idle_wait_s=None):
        queued = await queue_one(redis_url, "polled")
        await until(ran, 1, tries=400)
    assert ran and ran[0] - queued > 0.2  # found at its poll turn (every 5 s), not rung


async def test_a_redis_that_lost_its_scripts_still_wakes_the_worker(redis_url: str) -> None:
    """``SCRIPT FLUSH`` (or a restart) while the worker waits: its claim answers NOSCRIPT
    and is sent again with the script loaded, at once."""
    ran: list[float] = []

    async def job(ctx: dict[str, Any], **kwargs: Any) -> None:
        ran.append(time.monotonic())

    async with idle_worker(redis_url, job, idle_wait_s=SLOW_S):
        client = RedisConnector.from_url(redis_url).client("queue")
        try:
            await client.script_flush()
        finally:
            await client.aclose()
        queued = await queue_one(redis_url, "flushed")
        await until(ran, 1, tries=100)
    assert ran and ran[0] - queued < SLOW_S / 5, ran  # not at the next poll


async def test_a_ring_that_reaches_a_worker_with_no_room_is_passed_on(redis_url: str) -> None:
    """An idle worker's claim goes out with its next wait on the bell. When that claim
    fills it (here: one slot, a slow job), the wait still out must not keep the next ring
    from a worker that has room: the full one passes it on, and the other runs the job at
    once, not at its next poll."""
    first_started = asyncio.Event()
    ran: dict[str, float] = {}

    async def slow(ctx: dict[str, Any], **kwargs: Any) -> None:
        first_started.set()
        await asyncio.sleep(3)

    async def job(ctx: dict[str, Any], **kwargs: Any) -> None:
        ran[ctx["job_id"]] = time.monotonic()

    async with idle_worker(redis_url, slow, idle_wait_s=SLOW_S, max_jobs=1):
        await queue_one(redis_url, "fills-the-first")
        await asyncio.wait_for(first_started.wait(), SLOW_S / 5)
        # the second worker starts waiting on the bell after the full one's wait went out:
        # Redis hands the next ring to the full one (the longest waiting)
        async with idle_worker(redis_url, job, idle_wait_s=SLOW_S):
            queued = await queue_one(redis_url, "for-the-second")
            await until(ran, 1, tries=100)
    assert "for-the-second" in ran, ran
    assert ran["for-the-second"] - queued < SLOW_S / 5, ran  # not at a poll or wait's end
