"""One bad row fails alone: the sql sink against real Postgres and real SQLite files.

Postgres refuses U+0000 in text and jsonb; the sink stores it as U+FFFD there (SQLite
keeps it). A row that still cannot be stored (here: ``input_tokens`` beyond the INTEGER
column's range) is refused on its own with :class:`SinkRowsRejected`; every other row of
the write, and every other caller's write grouped with it, is committed.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkError, SinkRejected, SinkRowsRejected
from sinks.registry import create_sink, validate_sink_config
from sinks.sql import SqlSink
from tests.servers import TcpProxy
from tests.sinks.helpers import Backend, PostgresBackend, SqliteBackend, envelope

TOO_BIG = 10**20  # beyond Postgres INTEGER and SQLite's 64-bit INTEGER alike
NUL, REPLACEMENT = "\x00", "\ufffd"


def bad(i: int) -> Envelope:
    env = envelope(i)
    env.input_tokens = TOO_BIG
    return env


def with_nul(i: int) -> Envelope:
    """NUL in output_text, in the body's text, in JSON keys and values, in error."""
    env = envelope(i, text=f"a{NUL}b")
    assert env.body is not None
    env.body[f"key{NUL}"] = {f"nested{NUL}key": [f"v{NUL}"]}
    env.metadata[f"label{NUL}"] = f"x{NUL}y"
    env.error = {"code": f"c{NUL}", "message": f"m{NUL}"}
    env.model = f"model{NUL}"
    return env


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return SqliteBackend(tmp_path)
    return PostgresBackend(request.getfixturevalue("pg_url"), request.getfixturevalue("pg_table"))


@pytest.fixture
async def sink(backend: Backend) -> AsyncIterator[SqlSink]:
    opened = create_sink("s", validate_sink_config("s", backend.config()))
    assert isinstance(opened, SqlSink)
    await opened.open()
    yield opened
    await opened.aclose()


def count_flushes(sink: SqlSink) -> list[int]:
    """Record the row count of every flush (one transaction each) the sink runs."""
    sizes: list[int] = []
    coalescer = sink._coalescer
    flush = coalescer._flush

    async def counted(envelopes: list[Envelope]) -> None:
        sizes.append(len(envelopes))
        await flush(envelopes)

    coalescer._flush = counted
    return sizes


async def stored(backend: Backend) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in await backend.read()}


@pytest.mark.parametrize("rows", [3, 60], ids=["executemany", "copy"])
async def test_nul_is_stored_with_the_documented_rule(
    backend: Backend, sink: SqlSink, rows: int
) -> None:
    """NUL round-trips: U+FFFD on Postgres (text columns and JSON keys and values), exact
    on SQLite. The rows written with it land too."""
    envs = [envelope(i) for i in range(rows - 1)] + [with_nul(999)]
    await sink.write(envs)
    found = await stored(backend)
    assert len(found) == rows
    row = found["resp_999"]
    c = REPLACEMENT if isinstance(backend, PostgresBackend) else NUL
    assert row["output_text"] == f"a{c}b"
    assert row["model"] == f"model{c}"
    assert row["body"]["output"][-1]["content"][0]["text"] == f"a{c}b"
    assert row["body"][f"key{c}"] == {f"nested{c}key": [f"v{c}"]}
    assert row["metadata"][f"label{c}"] == f"x{c}y"
    assert row["error"] == {"code": f"c{c}", "message": f"m{c}"}
    assert found["resp_0"]["output_text"] == "positive"


async def test_nul_in_one_callers_write_fails_no_caller(backend: Backend, sink: SqlSink) -> None:
    """Concurrent callers share one flush; a NUL in one of them is stored, not an error."""
    flushes = count_flushes(sink)
    writes = [[envelope(i)] for i in range(5)] + [[envelope(10), with_nul(11), envelope(12)]]
    results = await asyncio.gather(*(sink.write(w) for w in writes), return_exceptions=True)
    assert results == [None] * 6
    assert flushes == [8]  # one grouped transaction
    assert sorted(await stored(backend)) == sorted(e.key for w in writes for e in w)


@pytest.mark.parametrize("size", [4, 60], ids=["executemany", "copy"])
async def test_bad_row_fails_only_its_caller(backend: Backend, sink: SqlSink, size: int) -> None:
    """One caller's out-of-range rows: every innocent caller succeeds, the bad caller gets
    SinkRowsRejected naming only its bad keys, and its good rows are stored."""
    flushes = count_flushes(sink)
    innocent = [[envelope(1000 * c + i) for i in range(size)] for c in range(1, 4)]
    guilty = [envelope(i) for i in range(size)]
    guilty[1] = bad(1)
    guilty[-1] = bad(size - 1)
    writes = [innocent[0], guilty, innocent[1], innocent[2], [envelope(9999)]]
    results = await asyncio.gather(*(sink.write(w) for w in writes), return_exceptions=True)
    assert flushes[0] == sum(len(w) for w in writes)  # they really were grouped
    error = results[1]
    assert isinstance(error, SinkRowsRejected), error
    assert error.sink == "s"
    assert set(error.rejected) == {"resp_1", f"resp_{size - 1}"}
    assert all("range" in reason or "too large" in reason for reason in error.rejected.values())
    assert results[:1] + results[2:] == [None] * 4
    expected = {e.key for w in writes for e in w} - set(error.rejected)
    assert set(await stored(backend)) == expected


async def test_rejected_later_version_keeps_the_earlier_callers_version(
    backend: Backend, sink: SqlSink
) -> None:
    """Latest write of a key wins, as if the callers wrote one after the other: when the
    later version is refused, the earlier caller's version is what stays."""
    first = envelope(7, "first")
    later = bad(7)
    results = await asyncio.gather(
        sink.write([first, envelope(8)]), sink.write([later, envelope(9)]), return_exceptions=True
    )
    assert results[0] is None
    assert isinstance(results[1], SinkRowsRejected) and set(results[1].rejected) == {"resp_7"}
    found = await stored(backend)
    assert sorted(found) == ["resp_7", "resp_8", "resp_9"]
    assert found["resp_7"]["output_text"] == "first"
    assert found["resp_7"]["input_tokens"] == first.input_tokens


async def test_thousand_rows_with_three_bad_store_997(backend: Backend, sink: SqlSink) -> None:
    """A batch chunk of 1,000 rows with 3 bad ones: 997 stored, exactly 3 rejected, found
    by bisection in a bounded number of transactions (about log2(n) per bad row)."""
    flushes = count_flushes(sink)
    envs = [envelope(i) for i in range(1000)]
    bad_keys = set()
    for i in (0, 500, 999):
        envs[i] = bad(i)
        bad_keys.add(f"resp_{i}")
    with pytest.raises(SinkRowsRejected) as info:
        await sink.write(envs)
    assert set(info.value.rejected) == bad_keys
    assert "3 of 1000" in str(info.value)
    found = await stored(backend)
    assert len(found) == 997 and not bad_keys & set(found)
    assert len(flushes) <= 1 + 3 * 2 * math.ceil(math.log2(1000))


async def test_every_row_bad_rejects_them_all(backend: Backend, sink: SqlSink) -> None:
    envs = [bad(i) for i in range(5)]
    with pytest.raises(SinkRowsRejected) as info:
        await sink.write(envs)
    assert set(info.value.rejected) == {e.key for e in envs}
    assert await backend.read() == []


async def test_postgres_down_is_transient_then_bad_rows_fail_alone(
    pg_url: str, pg_table: str
) -> None:
    """Postgres unreachable: a plain SinkError for the whole write (retry it all), never a
    rejection. Once it is back, the same write stores its good rows and rejects the bad."""
    proxy = TcpProxy("127.0.0.1", 5432)
    await proxy.up()
    url = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    assert url != pg_url
    config = {"type": "sql", "url": url, "table": pg_table, "timeout_s": 3}
    sink = create_sink("s", validate_sink_config("s", config))
    await sink.open()
    try:
        envs = [envelope(i) for i in range(60)] + [bad(60)]
        await proxy.down()
        for rows in (envs, envs[-3:]):  # the COPY path and the executemany path
            with pytest.raises(SinkError) as info:
                await sink.write(rows)
            assert not isinstance(info.value, SinkRejected), info.value
        await proxy.up()
        with pytest.raises(SinkRowsRejected) as rejected:
            await sink.write(envs)
        assert set(rejected.value.rejected) == {"resp_60"}
    finally:
        await sink.aclose()
        await proxy.down()
    assert len(await PostgresBackend(pg_url, pg_table).read()) == 60


async def test_sqlite_locked_is_transient(tmp_path: Path) -> None:
    """SQLite busy (another process holds the write lock): a plain SinkError for the whole
    write, never a rejection."""
    backend = SqliteBackend(tmp_path)
    sink = create_sink("s", validate_sink_config("s", backend.config()))
    assert isinstance(sink, SqlSink)
    await sink.open()
    # the same sink on an engine with a short busy timeout (the sink waits 30 s)
    await sink.engine.dispose()
    sink._engine = create_async_engine(
        f"sqlite+aiosqlite:///{backend.path}", connect_args={"timeout": 0.2}
    )
    holder = sqlite3.connect(backend.path)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        with pytest.raises(SinkError) as info:
            await sink.write([envelope(1), bad(2)])
        assert not isinstance(info.value, SinkRejected), info.value
        assert "locked" in str(info.value)
    finally:
        holder.rollback()
        holder.close()
        await sink.aclose()
