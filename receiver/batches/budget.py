"""The bytes of batch chunks one worker process holds at once, bounded across its batches.

:class:`ChunkBudget` is one count of raw bytes for the whole process
(``batch.inflight_bytes``): a batch's stream waits, in the order the batches asked, for
room for a whole chunk (``batch.chunk_bytes``) before it parses the next, then holds what
the chunk turned out to be. A chunk larger than the budget still goes, alone.
:class:`ChunkTicket` gives a chunk's bytes back once the last of its sinks is done.

See docs/batches.md (streaming, chunks and resumption).
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["ChunkBudget", "ChunkTicket"]


class ChunkBudget:
    """Raw bytes of chunks held at once, at most ``limit`` (0: no bound), first come first
    served."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        """Bytes held now."""
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, size: int) -> bool:
        return self.limit <= 0 or self.held == 0 or self.held + size <= self.limit

    async def acquire(self, size: int) -> None:
        """Wait until ``size`` more bytes fit (or nothing else is held), then hold them."""
        if not self._waiters and self._fits(size):
            self.held += size
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (size, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(size)  # granted as the cancel came: give it back
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, size: int) -> None:
        self.held -= size
        self._wake()

    def resize(self, held: int, size: int) -> None:
        """Bytes held as ``held`` become ``size`` (a reservation turned into the chunk it
        was for: what is left over is free again; a chunk over it is held anyway)."""
        self.held += size - held
        if size < held:
            self._wake()

    def _wake(self) -> None:
        while self._waiters:
            size, future = self._waiters[0]
            if future.done():
                self._waiters.popleft()
                continue
            if not self._fits(size):
                return
            self._waiters.popleft()
            self.held += size
            future.set_result(None)


class ChunkTicket:
    """One chunk's hold on the budget, shared by the ``sinks`` that write it: the bytes go
    back when the last one is :meth:`done` (or at once on :meth:`close`)."""

    __slots__ = ("_budget", "_left", "size")

    def __init__(self, budget: ChunkBudget, size: int, sinks: int) -> None:
        self._budget = budget
        self.size = size
        self._left = sinks
        if sinks <= 0:
            budget.release(size)

    @property
    def open(self) -> bool:
        return self._left > 0

    def done(self) -> None:
        """One sink is done with the chunk."""
        if self._left > 0:
            self._left -= 1
            if self._left == 0:
                self._budget.release(self.size)

    def close(self) -> None:
        """The run ends: whatever sinks did not get to, the bytes go back now."""
        if self._left > 0:
            self._left = 0
            self._budget.release(self.size)
