"""One source of truth for the envelope's columns: the Envelope dataclass.

The sql sink's table, the rows it sends to Postgres (executemany and COPY), the rows it
sends to SQLite and the envelope docs all follow :data:`nopoll.envelope.COLUMNS`; these
tests fail when one of them drifts from it.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from nopoll.envelope import COLUMNS, FIELDS, PRIMARY_KEY, Envelope
from sinks import _postgres
from sinks.registry import create_sink, validate_sink_config
from sinks.sql import results_table
from tests.sinks.helpers import Backend, PostgresBackend, SqliteBackend, normalize_row

# The table the sink creates: a change here changes users' tables, so it must come with its
# migration (schema 3 turned the primary key (provider, key) into (provider, key, tenant):
# sinks.sql._rekey; tests/sinks/test_sql_rekey.py).
POSTGRES_DDL = """
CREATE TABLE nopoll_results (
	provider VARCHAR NOT NULL,
	key VARCHAR NOT NULL,
	tenant VARCHAR NOT NULL,
	kind VARCHAR NOT NULL,
	response_id VARCHAR,
	batch_id VARCHAR,
	custom_id VARCHAR,
	status VARCHAR NOT NULL,
	usable BOOLEAN NOT NULL,
	incomplete_reason VARCHAR,
	model VARCHAR,
	output_text VARCHAR,
	input_tokens INTEGER,
	output_tokens INTEGER,
	error JSONB,
	metadata JSONB,
	event_id VARCHAR,
	received_at TIMESTAMP WITH TIME ZONE NOT NULL,
	fetched_at TIMESTAMP WITH TIME ZONE NOT NULL,
	body JSONB,
	PRIMARY KEY (provider, key, tenant)
)
"""


def test_every_envelope_field_is_a_column_in_contract_order() -> None:
    names = [f.name for f in dataclasses.fields(Envelope)]
    assert list(FIELDS) == names == [c.name for c in COLUMNS]
    assert names[:4] == ["provider", "tenant", "kind", "key"]
    assert set(PRIMARY_KEY) <= set(names)


def test_a_column_is_nullable_exactly_when_its_field_may_be_none_or_is_json() -> None:
    annotations = {f.name: str(f.type) for f in dataclasses.fields(Envelope)}
    for column in COLUMNS:
        may_be_none = "None" in annotations[column.name]
        assert column.nullable == (may_be_none or column.type == "json"), column


def test_column_types_follow_the_field_annotations() -> None:
    annotations = {f.name: str(f.type) for f in dataclasses.fields(Envelope)}
    expected = {"int | None": "integer", "bool": "boolean"}
    for column in COLUMNS:
        annotation = annotations[column.name]
        if column.type == "json":
            assert annotation.startswith("dict["), column
        elif column.type == "timestamp":
            assert annotation == "str" and column.name.endswith("_at"), column
        else:
            assert column.type == expected.get(annotation, "text"), column


def test_the_table_is_the_one_the_migrations_lead_to() -> None:
    table = results_table("nopoll_results")
    ddl = str(sa.schema.CreateTable(table).compile(dialect=postgresql.dialect()))
    assert [line.rstrip() for line in ddl.strip().splitlines()] == POSTGRES_DDL.strip().splitlines()
    assert {c.name for c in table.columns} == set(FIELDS)
    assert [c.name for c in table.primary_key.columns] == list(PRIMARY_KEY)


def test_the_postgres_record_follows_the_columns() -> None:
    env = full_envelope(1)
    record = _postgres._record(env)
    assert len(record) == len(FIELDS)
    for column, value in zip(COLUMNS, record, strict=True):
        original = getattr(env, column.name)
        if column.type == "timestamp":
            assert isinstance(value, datetime) and value.isoformat()[:23] == original[:23]
        else:
            assert value == original, column.name


def test_the_envelope_docs_list_every_field() -> None:
    docs = Path(__file__).parents[2] / "docs" / "envelope.md"
    table = docs.read_text().split("## ", 2)[0]
    documented = set(re.findall(r"^\| (?:`\w+`(?:, )?)+", table, re.M))
    names = {n for row in documented for n in re.findall(r"`(\w+)`", row)}
    assert names == set(FIELDS)


def full_envelope(i: int) -> Envelope:
    """An envelope with every field set, each to a value no other field has."""
    return Envelope(
        provider="prov",
        tenant=f"tenant-{i}",
        kind="batch_row",
        key=f"batch_{i}/cid-{i}",
        response_id=f"resp_{i}",
        batch_id=f"batch_{i}",
        custom_id=f"cid-{i}",
        status="incomplete",
        usable=True,
        incomplete_reason="max_output_tokens",
        model=f"model-{i}",
        output_text=f"text {i}",
        input_tokens=1000 + i,
        output_tokens=2000 + i,
        error={"code": f"c{i}", "message": f"m{i}"},
        metadata={"label": f"l{i}", "n": i},
        event_id=f"msg_{i}",
        received_at="2026-11-29T10:00:00.123Z",
        fetched_at="2026-11-29T10:00:01.456Z",
        body={"id": f"resp_{i}", "object": "response", "n": i},
    )


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: Any, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return SqliteBackend(tmp_path)
    return PostgresBackend(request.getfixturevalue("pg_url"), request.getfixturevalue("pg_table"))


@pytest.mark.parametrize("rows", [3, _postgres.COPY_MIN_ROWS + 10], ids=["values", "copy"])
async def test_every_field_lands_in_its_own_column(backend: Backend, rows: int) -> None:
    """Each field set to a value of its own: a column mapped to another field shows."""
    sink = create_sink("s", validate_sink_config("s", backend.config()))
    await sink.open()
    try:
        envs = [full_envelope(i) for i in range(rows)]
        await sink.write(envs)
    finally:
        await sink.aclose()
    stored = {r["key"]: normalize_row(r) for r in await backend.read()}
    assert len(stored) == rows
    for env in envs:
        row = stored[env.key]
        assert {name: row[name] for name in FIELDS} == env.to_dict()
