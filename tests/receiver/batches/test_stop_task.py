"""A batch run told to stop (its lease lost) stops even when the first cancel is lost.

Python 3.11's ``asyncio.timeout`` can take a cancel that races its own expiry for its own,
uncancel the task and raise TimeoutError, which the code around it (a sink queue's put
with a deadline) retries: the run then went on to the end without its lease. It happened
once in CI (``test_a_batch_that_cannot_renew_its_lease_stops_before_the_lock_expires``
got a whole run back). Here the loss is made on purpose, the way the timeout makes it.
"""

from __future__ import annotations

import asyncio

from receiver.batches.runner import stop_task
from receiver.queue._arq import settle_cancelled


async def _loses_cancels(lost: int, steps: list[str]) -> str:
    """A run that loses its first ``lost`` cancels as a racing timeout does, then obeys."""
    for _ in range(lost):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()  # what asyncio.timeout does when it takes the cancel for its own
            steps.append("lost")
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        steps.append("stopped")
        raise
    return "ran to the end"


async def test_a_lost_cancel_is_sent_again_until_the_run_stops() -> None:
    steps: list[str] = []
    task = asyncio.create_task(_loses_cancels(2, steps))
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        await stop_task(task)
    assert task.cancelled()
    assert steps == ["lost", "lost", "stopped"]


async def test_a_run_busy_with_its_cancel_is_not_cancelled_again_mid_clean_up() -> None:
    cleaned: list[str] = []

    async def run() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(1.2)  # clean-up that outlasts two of stop_task's checks
            cleaned.append("done")

    task = asyncio.create_task(run())
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        await stop_task(task)
    assert task.cancelled()
    assert cleaned == ["done"]


async def test_a_task_that_never_stops_is_left_after_the_limit_and_said(caplog) -> None:
    """A worker's close waits for its cancelled jobs this way: bounded, never forever (a
    job that kept losing its cancel once hung a test's worker close for two minutes)."""
    lost: list[str] = []
    done = asyncio.Event()

    async def stubborn() -> None:
        while not done.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                assert task is not None
                task.uncancel()
                lost.append("lost")

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        await settle_cancelled([task], 1.2)
    assert not task.done() and len(lost) >= 2  # each lost cancel was sent again
    assert "1 job(s) still running 1 s after they were cancelled" in caplog.text
    done.set()
    task.cancel()
    await asyncio.wait([task], timeout=5)
    assert task.done()
