"""A worker stopped while its Postgres sink is still opening (a rolling deploy, a test's
teardown: the start-up's first write is cancelled) leaves no connection behind: every
socket the open made is closed, none is left for the garbage collector to find (which
warns, and holds a server connection until then)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
import warnings
from pathlib import Path
from urllib.parse import urlsplit

from nopoll.exceptions import SinkError
from receiver.fanout.fanout import ManagedSink
from receiver.metrics import Metrics
from sinks.registry import create_sink, validate_sink_config


def sockets_to(port: int) -> int:
    """This process's open TCP sockets to ``port`` on 127.0.0.1 (from /proc)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
            count += 1
    return count


async def test_an_open_cancelled_at_any_point_leaves_no_connection(
    pg_url: str, pg_table: str
) -> None:
    config = validate_sink_config("w", {"type": "sql", "url": pg_url, "table": pg_table})
    port = urlsplit(pg_url).port or 5432
    before = sockets_to(port)
    # how long a whole open takes here, then cancel at points spread over it
    sink = create_sink("w", config)
    started = time.monotonic()
    await sink.open()
    whole = time.monotonic() - started
    await sink.aclose()

    leaks: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        for step in range(24):
            managed = ManagedSink("w", config, Metrics())
            task = asyncio.create_task(managed.write([]))  # the worker's start-up open
            await asyncio.sleep(whole * step / 20)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SinkError):
                await task
            await managed.aclose()  # what the fan-out does on stop
            gc.collect()
        leaks = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    assert leaks == []
    assert sockets_to(port) == before
