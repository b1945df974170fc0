"""The per-process byte budget of batch chunks in flight (:mod:`receiver.batches.budget`)."""

from __future__ import annotations

import asyncio

from receiver.batches.budget import ChunkBudget, ChunkTicket
from receiver.batches.progress import ChunkBounds


async def test_a_chunk_waits_for_room_and_goes_when_the_last_sink_is_done() -> None:
    budget = ChunkBudget(100)
    await budget.acquire(60)
    ticket = ChunkTicket(budget, 60, sinks=2)
    waiting = asyncio.create_task(budget.acquire(60))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    ticket.done()
    await asyncio.sleep(0.01)
    assert not waiting.done()  # one sink still holds the chunk
    ticket.done()
    await asyncio.wait_for(waiting, 1)
    assert budget.held == 60


async def test_a_chunk_larger_than_the_budget_goes_alone_and_order_is_kept() -> None:
    budget = ChunkBudget(100)
    await budget.acquire(500)  # nothing else held: it goes
    first = asyncio.create_task(budget.acquire(80))
    second = asyncio.create_task(budget.acquire(10))
    await asyncio.sleep(0.01)
    assert not first.done() and not second.done()  # the small one does not jump the queue
    budget.release(500)
    await asyncio.wait_for(asyncio.gather(first, second), 1)
    assert budget.held == 90


async def test_a_cancelled_waiter_and_a_closed_ticket_give_everything_back() -> None:
    budget = ChunkBudget(100)
    await budget.acquire(100)
    ticket = ChunkTicket(budget, 100, sinks=3)
    waiting = asyncio.create_task(budget.acquire(50))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    ticket.done()
    ticket.close()  # the run stopped before its other sinks got the chunk
    ticket.done()
    assert budget.held == 0


def test_chunk_bounds_are_stored_in_the_form_older_versions_read_when_rows_only() -> None:
    assert ChunkBounds(1000).encode() == "1000"
    assert ChunkBounds.decode("1000") == ChunkBounds(1000, 0)
    stored = ChunkBounds(1000, 2 * 1024 * 1024).encode()
    assert ChunkBounds.decode(stored) == ChunkBounds(1000, 2 * 1024 * 1024)
    try:  # what a version from before byte bounds does with it: it cannot cut by it
        int(stored)
    except ValueError:
        pass
    else:
        raise AssertionError("an older worker would read the row bound alone")
