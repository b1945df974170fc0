"""Same envelope, same SQL semantics on SQLite and Postgres: a JSON column holding no value
is SQL NULL (``WHERE error IS NULL``), never the JSON text ``'null'``; tables written by an
older nopoll are migrated."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg
import pytest

from nopoll.envelope import Envelope
from sinks.registry import create_sink, validate_sink_config
from sinks.sql import SCHEMA_VERSION
from tests.sinks.helpers import envelope

QUERIES = {
    "error": "SELECT count(*) FROM {t} WHERE error IS NULL",
    "body": "SELECT count(*) FROM {t} WHERE body IS NULL",
    "metadata": "SELECT count(*) FROM {t} WHERE metadata IS NULL",
    "json_null": "SELECT count(*) FROM {t} WHERE error IS NOT NULL",
}


def envelopes(n: int) -> list[Envelope]:
    """Every third with an error, every fourth without a body."""
    out = []
    for i in range(n):
        env = envelope(i)
        if i % 3 == 0:
            env.error = {"code": "server_error", "message": "boom"}
        if i % 4 == 0:
            env.body = None
        out.append(env)
    return out


async def write_all(config: dict, envs: list[Envelope]) -> None:
    sink = create_sink("s", validate_sink_config("s", config))
    await sink.open()
    try:
        await sink.write(envs)
    finally:
        await sink.aclose()


def sqlite_counts(path: Path, table: str = "nopoll_results") -> dict[str, int]:
    with sqlite3.connect(path) as conn:
        return {k: conn.execute(q.format(t=table)).fetchone()[0] for k, q in QUERIES.items()}


async def pg_counts(url: str, table: str) -> dict[str, int]:
    conn = await asyncpg.connect(url)
    try:
        return {k: await conn.fetchval(q.format(t=f'"{table}"')) for k, q in QUERIES.items()}
    finally:
        await conn.close()


@pytest.mark.parametrize("n", [10, 120])  # few rows: executemany; many: COPY on Postgres
async def test_is_null_agrees_between_sqlite_and_postgres(
    tmp_path: Path, pg_url: str, pg_table: str, n: int
) -> None:
    envs = envelopes(n)
    db = tmp_path / "r.db"
    await write_all({"type": "sql", "url": f"sqlite:///{db}"}, envs)
    await write_all({"type": "sql", "url": pg_url, "table": pg_table}, envs)
    expected = {
        "error": sum(e.error is None for e in envs),
        "body": sum(e.body is None for e in envs),
        "metadata": 0,
        "json_null": sum(e.error is not None for e in envs),
    }
    assert sqlite_counts(db) == expected
    assert await pg_counts(pg_url, pg_table) == expected


async def test_sqlite_table_with_json_null_text_is_migrated(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    await write_all({"type": "sql", "url": f"sqlite:///{db}"}, envelopes(6))
    with sqlite3.connect(db) as conn:  # what nopoll of schema version 1 wrote
        conn.execute("UPDATE nopoll_results SET error = 'null' WHERE error IS NULL")
        conn.execute("UPDATE nopoll_results SET body = 'null' WHERE body IS NULL")
        conn.execute("UPDATE nopoll_schema SET version = 1")
    assert sqlite_counts(db)["error"] == 0
    await write_all({"type": "sql", "url": f"sqlite:///{db}"}, [])
    assert sqlite_counts(db) == {"error": 4, "body": 2, "metadata": 0, "json_null": 2}
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM nopoll_schema").fetchone() == (SCHEMA_VERSION,)
        assert conn.execute("SELECT count(*) FROM nopoll_results").fetchone() == (6,)
    await write_all({"type": "sql", "url": f"sqlite:///{db}"}, [])  # again: nothing changes
    assert sqlite_counts(db) == {"error": 4, "body": 2, "metadata": 0, "json_null": 2}


async def test_postgres_table_with_json_null_is_migrated(pg_url: str, pg_table: str) -> None:
    config = {"type": "sql", "url": pg_url, "table": pg_table}
    await write_all(config, envelopes(6))
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f"UPDATE \"{pg_table}\" SET error = 'null' WHERE error IS NULL")
        await conn.execute("UPDATE nopoll_schema SET version = 1 WHERE table_name = $1", pg_table)
    finally:
        await conn.close()
    assert (await pg_counts(pg_url, pg_table))["error"] == 0
    await write_all(config, [])
    assert await pg_counts(pg_url, pg_table) == {
        "error": 4,
        "body": 2,
        "metadata": 0,
        "json_null": 2,
    }
    conn = await asyncpg.connect(pg_url)
    try:
        version = await conn.fetchval(
            "SELECT version FROM nopoll_schema WHERE table_name = $1", pg_table
        )
    finally:
        await conn.close()
    assert version == SCHEMA_VERSION
