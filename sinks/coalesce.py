"""Group commit for sinks: concurrent writes share one round trip and one transaction.

:class:`WriteCoalescer` queues the envelopes of concurrent ``write`` calls and flushes
them together (one commit, one fsync, instead of one per result); each caller still gets
its own outcome. The gathering itself is :class:`GroupCommit`, which the worker also uses
for job finishes (:mod:`receiver.queue._arq`). When a flush is refused for its data
(:class:`~nopoll.exceptions.SinkRejected`), the group is split by caller, then bisected,
until each refused row stands alone and fails only its caller
(:class:`~nopoll.exceptions.SinkRowsRejected`).

See docs/sinks/sql.md (one bad row fails alone).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from nopoll.exceptions import SinkRejected, SinkRowsRejected

if TYPE_CHECKING:
    from nopoll.envelope import Envelope

__all__ = ["GroupCommit", "WriteCoalescer"]

_T = TypeVar("_T")


class GroupCommit(Generic[_T]):
    """Concurrent calls share one round trip: what is handed in (:meth:`submit`) while a
    group is being committed waits, and goes in the next group, of at most ``max_size``
    (an item counts ``size(item)``; an item larger than that goes alone).

    ``commit(group)`` gets each item with its caller's future. It may settle futures
    itself; the ones it leaves succeed when it returns, or get the exception it raised
    (a cancellation cancels them and ends the group commit's task).
    """

    def __init__(
        self,
        commit: Callable[[list[tuple[_T, asyncio.Future[None]]]], Awaitable[object]],
        *,
        max_size: int | None = None,
        size: Callable[[_T], int] = lambda _: 1,
    ) -> None:
        self._commit = commit
        self._max_size = max_size
        self._size = size
        self._pending: deque[tuple[_T, asyncio.Future[None]]] = deque()
        self._task: asyncio.Task[None] | None = None

    async def submit(self, item: _T) -> None:
        """Hand ``item`` in; returns (or raises) once its group was committed."""
        await self.put(item)

    def put(self, item: _T) -> asyncio.Future[None]:
        """Hand ``item`` in without waiting: the future settles (or fails) once its group
        was committed (a caller that shields it makes no task of its own for that)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return future

    def _next_group(self) -> list[tuple[_T, asyncio.Future[None]]]:
        group = [self._pending.popleft()]
        total = self._size(group[0][0])
        while self._pending and (
            self._max_size is None or total + self._size(self._pending[0][0]) <= self._max_size
        ):
            group.append(self._pending.popleft())
            total += self._size(group[-1][0])
        return group

    async def _run(self) -> None:
        while self._pending:
            group = self._next_group()
            try:
                await self._commit(group)
            except Exception as exc:  # the destination failed: each caller retries it all
                for _, future in group:
                    if not future.done():
                        future.set_exception(exc)
            except BaseException:
                for _, future in group:
                    future.cancel()
                raise
            else:
                for _, future in group:
                    if not future.done():
                        future.set_result(None)


_Write = tuple[Sequence["Envelope"], asyncio.Future[None]]


class WriteCoalescer:
    """Merges concurrent writes into calls of ``flush(envelopes)`` of at most ``max_rows``
    (a :class:`GroupCommit` of writes), and finds the rows a refused flush refused."""

    def __init__(
        self, flush: Callable[[list[Envelope]], Awaitable[None]], *, max_rows: int = 5000
    ) -> None:
        self._flush = flush
        self._writes = GroupCommit(self._commit_group, max_size=max_rows, size=len)

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        await self._writes.submit(envelopes)

    async def _commit_group(self, group: list[_Write]) -> None:
        await self._commit(group, None)

    async def _commit(self, group: list[_Write], refused: SinkRejected | None) -> bool:
        """Commit the writes of ``group`` in their order and settle their callers; True when
        none had a refused row. ``refused``: the whole group is known to be refused."""
        if refused is None:
            try:
                await self._flush(_merged(group))
            except SinkRejected as exc:
                refused = exc
            else:
                for _, future in group:
                    if not future.done():
                        future.set_result(None)
                return True
        if len(group) == 1:
            rows = _merged(group)
            rejected = await self._bisect(rows, refused)
            future = group[0][1]
            if rejected and not future.done():
                future.set_exception(_rows_rejected(rejected, len(rows)))
            elif not future.done():
                future.set_result(None)
            return not rejected
        half = len(group) // 2
        clean = await self._commit(group[:half], None)
        # the first half all committed: what made the whole group fail is in the second
        return await self._commit(group[half:], refused if clean else None) and clean

    async def _bisect(
        self, rows: list[Envelope], refused: SinkRejected | None
    ) -> dict[str, SinkRejected]:
        """Commit every row that can be; return the refused ones' keys and errors.
        ``refused``: these rows as a whole are known to be refused."""
        if not rows:
            return {}
        if refused is None:
            try:
                await self._flush(rows)
            except SinkRejected as exc:
                refused = exc
            else:
                return {}
        if len(rows) == 1:
            return {rows[0].key: refused}
        half = len(rows) // 2
        rejected = await self._bisect(rows[:half], None)
        rejected |= await self._bisect(rows[half:], None if rejected else refused)
        return rejected


def _merged(group: list[_Write]) -> list[Envelope]:
    merged: dict[tuple[str, str, str], Envelope] = {}
    for envelopes, _ in group:
        for env in envelopes:
            merged[(env.provider, env.key, env.tenant)] = env  # the latest write of a key wins
    return list(merged.values())


def _rows_rejected(rejected: dict[str, SinkRejected], rows: int) -> SinkRowsRejected:
    reasons = {key: str(error.args[0]) for key, error in rejected.items()}
    first = next(iter(rejected.values()))
    return SinkRowsRejected(
        f"{len(rejected)} of {rows} rows refused for good, the others were written "
        f"(first: {first.args[0]})",
        sink=first.sink,
        rejected=reasons,
    )
