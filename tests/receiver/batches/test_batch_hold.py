"""The batch lease's holder task ends when the run ends, even when its renew is in flight.

A batch run that finds its batch already done ends at once, while the holder's first
renew may still be in flight. The holder is then cancelled; ``asyncio.wait_for`` on
Python 3.11 can swallow that cancel when the renew completes in the same turn of the
loop, and the holder (and the job) then ran on until the worker stopped.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from receiver.batches.runner import BatchRunner
from receiver.config import load_settings
from receiver.worker.liveness import DEAD_AFTER_S


class _Lease:
    """A lease whose renew completes when the test says so."""

    def __init__(self, answer: asyncio.Future[bool]) -> None:
        self.answer = answer
        self.lost = False
        self.renewing = asyncio.Event()

    async def renew(self, ttl_ms: int) -> bool:
        self.renewing.set()
        return await self.answer


@pytest.mark.parametrize("turns", [0, 1, 2])
async def test_a_holder_cancelled_while_its_renew_completes_stops(turns: int) -> None:
    settings = load_settings(None, env={}, overrides={"redis_url": "redis://127.0.0.1:9/0"})
    nothing: Any = None
    runner = BatchRunner(
        settings,
        redis=nothing,
        fanout=nothing,
        dead_letters=nothing,
        metrics=nothing,
        dead_after_s=DEAD_AFTER_S,
    )
    answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    lease = _Lease(answer)
    holder = asyncio.create_task(runner._hold(lease))
    await asyncio.wait_for(lease.renewing.wait(), 2)
    answer.set_result(True)  # the renew completes ...
    for _ in range(turns):
        await asyncio.sleep(0)
    holder.cancel()  # ... as the run ends and cancels its holder
    done, _ = await asyncio.wait({holder}, timeout=2)
    if not done:
        holder.cancel()  # a second cancel, so the test leaves nothing running
        await asyncio.wait({holder}, timeout=2)
    assert done and holder.cancelled(), "the holder went on renewing after its run ended"
