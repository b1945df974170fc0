"""Every sink through the same cases: write, rewrite, read back, failure.

Real backends: SQLite files, the machine's Postgres, the local filesystem.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkError
from sinks.registry import create_sink, validate_sink_config
from tests.sinks.helpers import Backend, PostgresBackend, SqliteBackend, envelope, normalize_row


class JsonlBackend(Backend):
    idempotent = False  # append-only: a replay adds a line (docs/sinks/jsonl.md: at least once)

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "jsonl"

    def config(self) -> dict[str, Any]:
        return {"type": "jsonl", "dir": str(self.dir)}

    async def read(self) -> list[dict[str, Any]]:
        rows = []
        for path in sorted(self.dir.glob("*/*.jsonl")):
            assert path.parent.name == "sim"  # one provider per file
            rows += [json.loads(line) for line in path.read_text().splitlines()]
        return rows

    def broken_config(self) -> dict[str, Any]:
        return {"type": "jsonl", "dir": "/proc/nopoll-cannot-write-here"}


@pytest.fixture(params=["sqlite", "postgres", "jsonl"])
def backend(request, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return SqliteBackend(tmp_path)
    if request.param == "jsonl":
        return JsonlBackend(tmp_path)
    return PostgresBackend(request.getfixturevalue("pg_url"), request.getfixturevalue("pg_table"))


@pytest.fixture
async def sink_of(backend: Backend) -> AsyncIterator[Callable[[], Any]]:
    sinks = []

    async def make():
        sink = create_sink("s", validate_sink_config("s", backend.config()))
        await sink.open()
        sinks.append(sink)
        return sink

    yield make
    for sink in sinks:
        await sink.aclose()


async def test_write_and_read_back(backend: Backend, sink_of) -> None:
    sink = await sink_of()
    envs = [envelope(i) for i in range(5)]
    await sink.write(envs)
    rows = sorted((normalize_row(r) for r in await backend.read()), key=lambda r: r["key"])
    assert len(rows) == 5
    for env, row in zip(envs, rows, strict=True):
        expected = env.to_dict()
        assert {k: normalize_row(row)[k] for k in expected} == expected


async def test_rewrite_is_idempotent(backend: Backend, sink_of) -> None:
    sink = await sink_of()
    await sink.write([envelope(1, "first")])
    await sink.write([envelope(1, "second"), envelope(2)])
    rows = await backend.read()
    keys = sorted(r["key"] for r in rows)
    if backend.idempotent:
        assert keys == ["resp_1", "resp_2"]
        assert {r["key"]: r["output_text"] for r in rows}["resp_1"] == "second"
    else:
        assert keys == ["resp_1", "resp_1", "resp_2"]


async def test_reopen_keeps_rows_and_schema(backend: Backend, sink_of) -> None:
    await (await sink_of()).write([envelope(1)])
    await (await sink_of()).write([envelope(2)])
    assert sorted({r["key"] for r in await backend.read()}) == ["resp_1", "resp_2"]


async def test_failure_raises_sink_error(backend: Backend) -> None:
    sink = create_sink("broken", validate_sink_config("broken", backend.broken_config()))
    with pytest.raises(SinkError) as info:
        await sink.open()
        await sink.write([envelope(1)])
    assert "broken" in str(info.value)
    await sink.aclose()


async def test_nul_character_lands(backend: Backend, sink_of) -> None:
    """A NUL in text and in JSON keys and values never fails a write, nor its neighbours."""
    env = envelope(1, "a\x00b")
    env.metadata["k\x00"] = "v\x00"
    await (await sink_of()).write([env, envelope(2)])
    rows = {r["key"]: r for r in await backend.read()}
    assert sorted(rows) == ["resp_1", "resp_2"]
    nul = backend.nul
    assert rows["resp_1"]["output_text"] == f"a{nul}b"
    assert rows["resp_1"]["metadata"][f"k{nul}"] == f"v{nul}"


async def test_write_nothing_is_a_no_op(backend: Backend, sink_of) -> None:
    await (await sink_of()).write([])
    assert await backend.read() == []


async def test_sql_adds_missing_columns(pg_url: str, pg_table: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            f'CREATE TABLE "{pg_table}" (provider text, key text, kind text, '
            "PRIMARY KEY (provider, key))"
        )
    finally:
        await conn.close()
    sink = create_sink(
        "s", validate_sink_config("s", {"type": "sql", "url": pg_url, "table": pg_table})
    )
    await sink.open()
    try:
        await sink.write([envelope(7)])
    finally:
        await sink.aclose()
    rows = await PostgresBackend(pg_url, pg_table).read()
    assert rows[0]["output_text"] == "positive" and rows[0]["body"]["id"] == "resp_7"


def test_envelope_round_trip() -> None:
    env = envelope(3)
    assert Envelope.from_dict(env.to_dict()) == env
    assert [f.name for f in dataclasses.fields(Envelope)][:4] == [
        "provider",
        "tenant",
        "kind",
        "key",
    ]


async def test_many_rows_round_trip_and_rewrite(backend: Backend, sink_of) -> None:
    """Batch-sized writes (COPY → staging → upsert on Postgres) keep one row per key."""
    sink = await sink_of()
    first = [envelope(i, "v1") for i in range(300)]
    await sink.write(first)
    await sink.write([envelope(i, "v2") for i in range(150, 450)])
    rows = {r["key"]: normalize_row(r) for r in await backend.read()}
    if backend.idempotent:
        assert len(rows) == 450
        assert rows["resp_10"]["output_text"] == "v1" and rows["resp_200"]["output_text"] == "v2"
        assert {k: rows["resp_7"][k] for k in first[7].to_dict()} == first[7].to_dict()


async def test_postgres_json_columns_use_lz4(pg_url: str, pg_table: str) -> None:
    sink = create_sink(
        "s", validate_sink_config("s", {"type": "sql", "url": pg_url, "table": pg_table})
    )
    await sink.open()
    await sink.aclose()
    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch(
            "SELECT attname, attcompression FROM pg_attribute WHERE attrelid = $1::regclass "
            "AND attname IN ('body', 'metadata', 'error')",
            pg_table,
        )
    finally:
        await conn.close()
    found = {r["attname"]: r["attcompression"] for r in rows}
    assert found == {"body": b"l", "metadata": b"l", "error": b"l"}
