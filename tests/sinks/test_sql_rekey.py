"""Schema 3: tenants' results with the same id are rows of their own. A table made with the
primary key ``(provider, key)`` gets ``(provider, key, tenant)``, its rows kept."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from nopoll.envelope import PRIMARY_KEY, Envelope
from sinks.registry import create_sink, validate_sink_config
from sinks.sql import SCHEMA_VERSION, _row, results_table


def envelope(tenant: str = "default", text: str = "first") -> Envelope:
    return Envelope(
        provider="sim",
        tenant=tenant,
        kind="response",
        key="resp_same",
        response_id="resp_same",
        status="completed",
        usable=True,
        output_text=text,
        received_at="2026-11-29T10:00:00.123Z",
        fetched_at="2026-11-29T10:00:01.456Z",
    )


async def make_old_table(url: str, name: str) -> None:
    """The table, schema row and one row as schema version 2 left them."""
    new = results_table(name)
    metadata = sa.MetaData()
    old = sa.Table(
        name,
        metadata,
        *(
            sa.Column(
                c.name, c.type, primary_key=c.name in ("provider", "key"), nullable=c.nullable
            )
            for c in new.columns
        ),
    )
    schema = sa.Table(
        "nopoll_schema",
        metadata,
        sa.Column("table_name", sa.String(63), primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
    )
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.execute(schema.insert().values(table_name=name, version=2))
        await conn.execute(old.insert().values(**_row(envelope())))
    await engine.dispose()


async def read(url: str, name: str) -> tuple[list[str], int, list[dict[str, Any]]]:
    engine = create_async_engine(url)
    async with engine.connect() as conn:
        pk = await conn.run_sync(lambda c: sa.inspect(c).get_pk_constraint(name))
        version = (
            await conn.execute(
                sa.text("SELECT version FROM nopoll_schema WHERE table_name = :t"), {"t": name}
            )
        ).scalar()
        rows = [dict(r._mapping) for r in await conn.execute(sa.text(f'SELECT * FROM "{name}"'))]
    await engine.dispose()
    return pk["constrained_columns"], version, rows


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: Any, tmp_path: Path) -> tuple[str, str]:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'old.db'}", "nopoll_results"
    url = request.getfixturevalue("pg_url").replace("postgresql://", "postgresql+asyncpg://")
    return url, request.getfixturevalue("pg_table")


async def test_an_old_table_gets_the_tenant_in_its_primary_key(database: tuple[str, str]) -> None:
    url, name = database
    await make_old_table(url, name)
    assert (await read(url, name))[0] == ["provider", "key"]
    sink = create_sink("db", validate_sink_config("db", {"type": "sql", "url": url, "table": name}))
    await sink.open()
    try:
        await sink.write([envelope("team-a", "theirs"), envelope("team-b", "others")])
        await sink.write([envelope("default", "rewritten")])  # an upsert, as before
    finally:
        await sink.aclose()
    pk, version, rows = await read(url, name)
    assert pk == list(PRIMARY_KEY) == ["provider", "key", "tenant"]
    assert version == SCHEMA_VERSION == 3
    assert sorted((r["tenant"], r["output_text"]) for r in rows) == [
        ("default", "rewritten"),
        ("team-a", "theirs"),
        ("team-b", "others"),
    ]
    again = create_sink(
        "db", validate_sink_config("db", {"type": "sql", "url": url, "table": name})
    )
    await again.open()  # opening again changes nothing
    await again.aclose()
    assert (await read(url, name))[:2] == (list(PRIMARY_KEY), 3)


async def test_a_new_table_is_made_with_the_tenant_in_its_key(database: tuple[str, str]) -> None:
    url, name = database
    sink = create_sink("db", validate_sink_config("db", {"type": "sql", "url": url, "table": name}))
    await sink.open()
    try:
        same = [envelope(t) for t in ("default", "team-a")]
        await sink.write(same)
        await sink.write([dataclasses.replace(same[1], output_text="again")])
    finally:
        await sink.aclose()
    pk, _, rows = await read(url, name)
    assert pk == list(PRIMARY_KEY)
    assert sorted((r["tenant"], r["output_text"]) for r in rows) == [
        ("default", "first"),
        ("team-a", "again"),
    ]
