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
import sqlalchemy as sa

from nopoll.envelope import Envelope, envelope_from_response
from nopoll.exceptions import SinkError
from receiver.demo.simulator import make_response
from sinks.registry import create_sink, validate_sink_config
from sinks.sql import SCHEMA_VERSION


def envelope(i: int, text: str = "positive") -> Envelope:
    body = make_response(f"resp_{i}", text=text, metadata={"label": "eval", "n": i})
    return envelope_from_response(
        body, provider="sim", received_at="2026-11-29T10:00:00.123Z", event_id=f"msg_{i}"
    )


class Backend:
    """How to configure one sink and read back what it holds."""

    idempotent = True
    nul = "\x00"  # what a NUL character in a string is stored as

    def config(self) -> dict[str, Any]:
        raise NotImplementedError

    async def read(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def broken_config(self) -> dict[str, Any]:
        raise NotImplementedError


class SqliteBackend(Backend):
    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "db" / "results.db"

    def config(self) -> dict[str, Any]:
        return {"type": "sql", "url": f"sqlite:///{self.path}"}

    async def read(self) -> list[dict[str, Any]]:
        engine = sa.create_engine(f"sqlite:///{self.path}")
        with engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM nopoll_results"))]
        engine.dispose()
        for r in rows:
            for col in ("body", "metadata", "error"):
                r[col] = json.loads(r[col]) if isinstance(r[col], str) else r[col]
        return rows

    def broken_config(self) -> dict[str, Any]:
        return {"type": "sql", "url": "sqlite:////proc/nopoll-cannot-write-here/x.db"}


class PostgresBackend(Backend):
    nul = "\ufffd"  # Postgres refuses U+0000 in text and jsonb: the sink stores U+FFFD

    def __init__(self, url: str, table: str) -> None:
        self.url, self.table = url, table

    def config(self) -> dict[str, Any]:
        return {"type": "sql", "url": self.url, "table": self.table}

    async def read(self) -> list[dict[str, Any]]:
        conn = await asyncpg.connect(self.url)
        try:
            rows = [dict(r) for r in await conn.fetch(f'SELECT * FROM "{self.table}"')]
            types = {
                r["column_name"]: r["data_type"]
                for r in await conn.fetch(
                    "SELECT column_name, data_type FROM information_schema.columns "
                    "WHERE table_name=$1",
                    self.table,
                )
            }
            assert types["body"] == "jsonb" and types["metadata"] == "jsonb"
            version = await conn.fetchval(
                "SELECT version FROM nopoll_schema WHERE table_name=$1", self.table
            )
            assert version == SCHEMA_VERSION
        finally:
            await conn.close()
        for r in rows:
            for col in ("body", "metadata", "error"):
                r[col] = json.loads(r[col]) if isinstance(r[col], str) else r[col]
        return rows

    def broken_config(self) -> dict[str, Any]:
        return {"type": "sql", "url": "postgresql://postgres@127.0.0.1:1/none", "timeout_s": 3}


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


def normalize_row(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for col in ("received_at", "fetched_at"):
        value = out[col]
        if not isinstance(value, str):
            out[col] = value.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        elif "T" not in value:  # SQLite stores "2026-11-29 10:00:00.123000+00:00"
            out[col] = value.replace(" ", "T")[:23] + "Z"
    return out


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
