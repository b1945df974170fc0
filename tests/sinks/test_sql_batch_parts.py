"""The sql sink's batch chunks on Postgres: a plain ``COPY`` while the keys are new, the
upsert when one is stored already (a resumed chunk), a repeated key, or a refused row."""

from __future__ import annotations

import asyncpg
import pytest

from nopoll.exceptions import SinkRowsRejected
from sinks.registry import create_sink, validate_sink_config
from tests.sinks.helpers import envelope


async def rows(url: str, table: str) -> dict[str, str]:
    conn = await asyncpg.connect(url)
    try:
        found = await conn.fetch(f'SELECT key, output_text FROM "{table}"')
        return {r["key"]: r["output_text"] for r in found}
    finally:
        await conn.close()


@pytest.fixture
async def sink(pg_url, pg_table):
    sink = create_sink(
        "db", validate_sink_config("db", {"type": "sql", "url": pg_url, "table": pg_table})
    )
    await sink.open()
    yield sink
    await sink.aclose()


async def test_new_keys_are_copied_and_a_rewritten_chunk_upserts(sink, pg_url, pg_table):
    first = [envelope(i, text="first") for i in range(120)]
    await sink.write_batch_part(0, first)
    assert sink._upserts_left == 0  # the plain COPY took them
    assert len(await rows(pg_url, pg_table)) == 120

    # a resumed run writes chunk 0 again (its rows changed meanwhile) and goes on
    again = [envelope(i, text="second") for i in range(60, 180)]
    await sink.write_batch_part(0, again)
    assert sink._upserts_left > 0  # the COPY met a stored key and was rolled back whole
    stored = await rows(pg_url, pg_table)
    assert len(stored) == 180
    assert {stored[e.key] for e in again} == {"second"}
    assert {stored[e.key] for e in first[:60]} == {"first"}


async def test_a_key_twice_in_one_chunk_is_written_once_latest_first(sink, pg_url, pg_table):
    part = [envelope(i) for i in range(100)] + [envelope(5, text="later")]
    await sink.write_batch_part(3, part)
    stored = await rows(pg_url, pg_table)
    assert len(stored) == 100 and stored[part[5].key] == "later"


async def test_a_refused_row_fails_alone(sink, pg_url, pg_table):
    part = [envelope(i) for i in range(100)]
    part[7].input_tokens = 2**40  # beyond the integer column
    with pytest.raises(SinkRowsRejected) as caught:
        await sink.write_batch_part(0, part)
    assert set(caught.value.rejected) == {part[7].key}
    assert len(await rows(pg_url, pg_table)) == 99
