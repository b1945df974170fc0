"""asyncio's sharp edges on Python 3.11, in one place: a cancel can be lost when it races a
timeout inside a task, or be turned into a connection error by a library, and a task that
then runs on keeps a stopping process alive. Waiting for cancelled tasks is bounded here,
and a stuck task says where it stands."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("nopoll")


async def settle_cancelled(tasks: Sequence[asyncio.Task[Any]], limit_s: float) -> None:
    """Wait up to ``limit_s`` for cancelled ``tasks`` to end. Python 3.11 can lose a cancel
    that races an ``asyncio.timeout`` inside a task, which then runs on: the cancel is sent
    again to a task that no longer counts one pending (never to one still acting on one, so
    its clean-up is not cut short). What is still running then is logged and left: a close
    must not wait forever."""
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + limit_s
    while pending and time.monotonic() < deadline:
        for task in pending:
            if task.cancelling() == 0:
                task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    for task in tasks:  # each outcome read, so none is reported as never retrieved
        if task.done() and not task.cancelled():
            task.exception()
    if pending:
        log.warning(
            "%d job(s) still running %.0f s after they were cancelled", len(pending), limit_s
        )


def where(task: asyncio.Task[Any]) -> str:
    """Where ``task`` is suspended: its innermost frames, for a log line."""
    return " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in task.get_stack(limit=6))


def cancel_requested() -> bool:
    """True when the running task was asked to stop. A loop that catches a library's
    connection errors checks it: redis-py can turn the cancel that ends the loop into one,
    and the loop would go on as if Redis had only failed."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def cancel_and_wait(task: asyncio.Task[Any], limit_s: float = 30.0) -> bool:
    """Cancel ``task`` and wait for it, sending the cancel again every half second (one the
    task swallowed is not counted as lost by asyncio, so it is never resent by itself), for
    ``limit_s`` at most; whether it ended. A task still running is logged with where it
    stands and left: a stop must not wait forever."""
    deadline = time.monotonic() + limit_s
    while not task.done() and time.monotonic() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=min(0.5, max(deadline - time.monotonic(), 0)))
    if not task.done():
        log.warning(
            "%s did not end %.0f s after it was cancelled (at %s)",
            task.get_name(),
            limit_s,
            where(task),
        )
        return False
    if not task.cancelled():
        task.exception()  # retrieved: the task logged what it hit
    return True
