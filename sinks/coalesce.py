"""Group commit for sinks: concurrent writes share one round trip and one transaction.

Many response jobs finish at once; writing each envelope in its own transaction costs a
commit (an fsync on Postgres and SQLite) per result. :class:`WriteCoalescer` queues the
envelopes of concurrent ``write`` calls and flushes them together: while one flush runs,
new writes gather for the next. Each caller still gets its own success or error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from receiver.envelope import Envelope

__all__ = ["WriteCoalescer"]


class WriteCoalescer:
    """Merges concurrent writes into calls of ``flush(envelopes)`` of at most ``max_rows``."""

    def __init__(
        self, flush: Callable[[list[Envelope]], Awaitable[None]], *, max_rows: int = 5000
    ) -> None:
        self._flush = flush
        self._max_rows = max_rows
        self._pending: list[tuple[Sequence[Envelope], asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((envelopes, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        await future

    async def _run(self) -> None:
        while self._pending:
            group: list[tuple[Sequence[Envelope], asyncio.Future[None]]] = []
            rows = 0
            while self._pending and (
                not group or rows + len(self._pending[0][0]) <= self._max_rows
            ):
                item = self._pending.pop(0)
                group.append(item)
                rows += len(item[0])
            merged: dict[tuple[str, str], Envelope] = {}
            for envelopes, _ in group:
                for env in envelopes:
                    merged[(env.provider, env.key)] = env  # the latest write of a key wins
            try:
                await self._flush(list(merged.values()))
            except Exception as exc:
                for _, future in group:
                    if not future.done():
                        future.set_exception(exc)
            else:
                for _, future in group:
                    if not future.done():
                        future.set_result(None)
