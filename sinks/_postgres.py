"""The ``sql`` sink's writes on Postgres: asyncpg directly, one round trip for a few rows,
``COPY`` for many.

:class:`PostgresWriter` upserts fewer than :data:`COPY_MIN_ROWS` rows with one prepared
``executemany``, more through a per-connection staging table filled by ``COPY``; a batch
chunk of likely new keys (:meth:`PostgresWriter.insert_new`) is copied straight into the
table, falling back to the upsert when a key exists. Connections skip asyncpg's reset
query. Every NUL character is stored as U+FFFD.

See docs/sinks/sql.md and docs/batches.md (Postgres).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import orjson

from nopoll.envelope import COLUMNS, FIELDS, PRIMARY_KEY, Envelope

__all__ = ["COPY_MIN_ROWS", "PostgresWriter", "parse_time"]

COPY_MIN_ROWS = 50
_NUL, _NUL_JSON, _REPLACEMENT = "\x00", b"\\u0000", "\ufffd"


def parse_time(value: str) -> datetime:
    """An envelope's RFC 3339 time as a datetime (``Z`` included)."""
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _text(value: str | None) -> str | None:
    """A text column's value as Postgres can store it: NUL becomes U+FFFD."""
    return value.replace(_NUL, _REPLACEMENT) if value is not None and _NUL in value else value


def _scrub(value: Any) -> Any:
    """``value`` with NUL replaced by U+FFFD in every string, JSON keys included."""
    if isinstance(value, str):
        return value.replace(_NUL, _REPLACEMENT)
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    return value


def _jsonb(value: Any) -> bytes:
    """jsonb in binary form: a version byte and orjson's text, NUL-free. The scan for an
    escaped NUL is the only cost on the usual path."""
    data = orjson.dumps(value)
    if _NUL_JSON in data:
        data = orjson.dumps(_scrub(value))
    return b"\x01" + data


# How each column type's value is sent (json goes through the jsonb codec: _jsonb).
_SEND: dict[str, Callable[[Any], Any] | None] = {
    "text": _text,
    "integer": None,
    "boolean": None,
    "json": None,
    "timestamp": parse_time,
}
_CONVERT = tuple(_SEND[c.type] for c in COLUMNS)
_values = operator.attrgetter(*FIELDS)


def _record(env: Envelope) -> tuple[Any, ...]:
    """An envelope as a row of :data:`~nopoll.envelope.COLUMNS`, ready for asyncpg."""
    return tuple(
        value if convert is None else convert(value)
        for convert, value in zip(_CONVERT, _values(env), strict=True)
    )


async def _keep_session(conn: Any) -> None:
    """Pool reset: nothing (asyncpg still rolls back an open transaction first)."""


class PostgresWriter:
    """Upserts envelopes into ``table`` through an asyncpg pool."""

    def __init__(self, table: str) -> None:
        self.table = table
        self._pool: Any = None
        self._stage = f"_nopoll_stage_{table}"[:63]
        cols = ", ".join(f'"{c}"' for c in FIELDS)
        keys = ", ".join(PRIMARY_KEY)
        updates = ", ".join(f'"{c}" = EXCLUDED."{c}"' for c in FIELDS if c not in PRIMARY_KEY)
        params = ", ".join(f"${i}" for i in range(1, len(FIELDS) + 1))
        upsert = f"ON CONFLICT ({keys}) DO UPDATE SET {updates}"
        self._values_sql = f'INSERT INTO "{table}" ({cols}) VALUES ({params}) {upsert}'
        self._merge_sql = (
            f'INSERT INTO "{table}" ({cols}) SELECT DISTINCT ON ({keys}) {cols} '
            f'FROM "{self._stage}" ORDER BY {keys} {upsert}'
        )

    async def open(self, dsn: str, *, pool_size: int, timeout_s: float) -> None:
        """Connect (the table must exist: the staging table is made ``LIKE`` it)."""
        import asyncpg

        stage_ddl = (
            f'CREATE TEMP TABLE IF NOT EXISTS "{self._stage}" '
            f'(LIKE "{self.table}" INCLUDING DEFAULTS) ON COMMIT DELETE ROWS'
        )

        async def init(conn: Any) -> None:
            # jsonb in binary form is a version byte and the JSON text: orjson bytes as-is
            await conn.set_type_codec(
                "jsonb",
                schema="pg_catalog",
                format="binary",
                encoder=_jsonb,
                decoder=lambda b: orjson.loads(b[1:]),
            )
            await conn.execute(stage_ddl)

        self._pool = await asyncpg.create_pool(
            dsn,
            min_size=1,
            max_size=pool_size,
            init=init,
            reset=_keep_session,
            timeout=10,
            command_timeout=timeout_s,
        )

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        """Upsert ``envelopes`` (one key at most once), all or none."""
        if self._pool is None:
            raise RuntimeError("the Postgres writer is not open")
        records = [_record(e) for e in envelopes]
        async with self._pool.acquire() as conn:
            if len(records) < COPY_MIN_ROWS:
                await conn.executemany(self._values_sql, records)
                return
            async with conn.transaction():
                await conn.copy_records_to_table(self._stage, records=records, columns=FIELDS)
                await conn.execute(self._merge_sql)

    async def insert_new(self, envelopes: Sequence[Envelope]) -> bool:
        """``COPY`` ``envelopes`` straight into the table, all or none; False (nothing
        written) when one of their keys is in the table already, or twice among them:
        then they need :meth:`write`."""
        if self._pool is None:
            raise RuntimeError("the Postgres writer is not open")
        import asyncpg

        records = [_record(e) for e in envelopes]
        async with self._pool.acquire() as conn:
            try:
                await conn.copy_records_to_table(self.table, records=records, columns=FIELDS)
            except asyncpg.UniqueViolationError:
                return False
        return True

    async def aclose(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()
