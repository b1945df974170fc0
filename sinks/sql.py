"""The ``sql`` sink: one row per result in Postgres (asyncpg) or SQLite (aiosqlite).

The table (``nopoll_results`` by default) has the envelope's columns with primary key
``(provider, key)``; every write is an upsert, so replays never duplicate. The sink
creates and migrates its own table (additive columns, a recorded schema version), also
when several sinks or processes open the same database at once: on SQLite the migration
holds the write lock from its first statement (``BEGIN IMMEDIATE``), on Postgres an
advisory lock.

An envelope field with no value (``error``, ``body``) is SQL NULL on both databases,
never the JSON text ``'null'``, so ``WHERE error IS NULL`` means the same everywhere.
Schema version 2 turns the JSON ``null`` that version 1 stored on SQLite (and any found on
Postgres) into NULL, once, in place.

Postgres refuses U+0000 in ``text`` and in ``jsonb``: there, and only there, every NUL
character is stored as U+FFFD, in the text columns and in the keys and values of the
``body``, ``metadata`` and ``error`` JSON alike. SQLite stores exactly what came.

One bad row fails alone: a row the database refuses for its data (a number beyond the
column's range, a broken constraint) makes the write raise
:class:`~nopoll.exceptions.SinkRowsRejected` naming that row's key, after every other
row was committed (see :mod:`sinks.coalesce`). An unreachable database, a timeout or any
other failure is a plain :class:`~nopoll.exceptions.SinkError` for the whole write.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
import sqlite3
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from pydantic import SecretStr, field_validator
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlmodel import Column, Field, SQLModel

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkError, SinkRejected
from sinks.base import SinkBase, SinkConfig
from sinks.coalesce import WriteCoalescer

__all__ = ["SCHEMA_VERSION", "NopollResult", "SqlSink", "SqlSinkConfig", "results_table"]

log = logging.getLogger("nopoll.sinks.sql")

SCHEMA_VERSION = 2
"""1: the first table. 2: JSON columns hold SQL NULL for no value, never JSON ``null``."""
_JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
_JSON_COLUMNS = ("error", "metadata", "body")
_SQL_NULL_SINCE = 2  # the schema version from which no value is SQL NULL
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class NopollResult(SQLModel, table=True):
    """One result row; column names and meanings are the envelope's."""

    __tablename__ = "nopoll_results"

    provider: str = Field(primary_key=True)
    key: str = Field(primary_key=True)
    tenant: str = Field(default="default")
    kind: str
    response_id: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    status: str
    usable: bool
    incomplete_reason: str | None = None
    model: str | None = None
    output_text: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: dict[str, Any] | None = Field(default=None, sa_column=Column("error", _JSON))
    meta: dict[str, Any] | None = Field(default=None, sa_column=Column("metadata", _JSON))
    event_id: str | None = None
    received_at: datetime = Field(sa_type=sa.DateTime(timezone=True))
    fetched_at: datetime = Field(sa_type=sa.DateTime(timezone=True))
    body: dict[str, Any] | None = Field(default=None, sa_column=Column("body", _JSON))


def results_table(name: str) -> sa.Table:
    """The results table under ``name``, in a metadata of its own."""
    return NopollResult.__table__.to_metadata(sa.MetaData(), name=name)  # type: ignore[attr-defined,no-any-return]


def _schema_table(metadata: sa.MetaData) -> sa.Table:
    return sa.Table(
        "nopoll_schema",
        metadata,
        sa.Column("table_name", sa.String(63), primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
    )


class SqlSinkConfig(SinkConfig):
    """``{type: sql, url: ..., table: nopoll_results}``."""

    type: Literal["sql"] = "sql"
    url: SecretStr
    """A SQLAlchemy URL; kept secret because it may hold a password."""
    table: str = "nopoll_results"
    pool_size: int = 5

    @field_validator("url", mode="before")
    @classmethod
    def _url(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        if value.startswith(("postgres://", "postgresql://")):
            value = "postgresql+asyncpg://" + value.split("://", 1)[1]
        elif value.startswith("sqlite://") and not value.startswith("sqlite+"):
            value = "sqlite+aiosqlite://" + value.split("://", 1)[1]
        if not value.startswith(("postgresql+asyncpg://", "sqlite+aiosqlite://")):
            raise ValueError("must be a postgresql:// or sqlite:/// URL")
        if value.startswith("postgresql") and not _installed("asyncpg"):
            raise ValueError(
                "a postgresql:// URL needs the asyncpg driver, which is not installed: "
                "pip install 'nopoll[postgres]' (from a clone: pip install '.[postgres]')"
            )
        return value

    @field_validator("table")
    @classmethod
    def _table(cls, value: str) -> str:
        if not _IDENT.match(value):
            raise ValueError("must be a plain SQL identifier ([A-Za-z_][A-Za-z0-9_]*)")
        return value


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


_COPY_MIN_ROWS = 50
_COLUMNS = (
    "provider",
    "key",
    "tenant",
    "kind",
    "response_id",
    "batch_id",
    "custom_id",
    "status",
    "usable",
    "incomplete_reason",
    "model",
    "output_text",
    "input_tokens",
    "output_tokens",
    "error",
    "metadata",
    "event_id",
    "received_at",
    "fetched_at",
    "body",
)


_NUL, _NUL_JSON, _REPLACEMENT = "\x00", b"\\u0000", "\ufffd"


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


def _record(env: Envelope) -> tuple[Any, ...]:
    """A Postgres row (JSON columns go through :func:`_jsonb`)."""
    return (
        _text(env.provider),
        _text(env.key),
        _text(env.tenant),
        _text(env.kind),
        _text(env.response_id),
        _text(env.batch_id),
        _text(env.custom_id),
        _text(env.status),
        env.usable,
        _text(env.incomplete_reason),
        _text(env.model),
        _text(env.output_text),
        env.input_tokens,
        env.output_tokens,
        env.error,
        env.metadata,
        _text(env.event_id),
        _parse_time(env.received_at),
        _parse_time(env.fetched_at),
        env.body,
    )


def _row(env: Envelope) -> dict[str, Any]:
    row = env.to_dict()
    row["received_at"] = _parse_time(env.received_at)
    row["fetched_at"] = _parse_time(env.fetched_at)
    return row


class SqlSink(SinkBase):
    """Upserts envelopes into a SQL table (Postgres or SQLite)."""

    config_model = SqlSinkConfig
    config: SqlSinkConfig

    def __init__(self, name: str, config: SqlSinkConfig) -> None:
        super().__init__(name, config)
        self.table = results_table(config.table)
        self._schema = _schema_table(self.table.metadata)
        self._engine: AsyncEngine | None = None
        self._upsert: Any = None
        self._pool: Any = None
        self._coalescer = WriteCoalescer(self._flush)
        table = config.table
        self._stage = f"_nopoll_stage_{table}"[:63]
        self._stage_ddl = (
            f'CREATE TEMP TABLE IF NOT EXISTS "{self._stage}" '
            f'(LIKE "{table}" INCLUDING DEFAULTS) ON COMMIT DELETE ROWS'
        )
        cols = ", ".join(f'"{c}"' for c in _COLUMNS)
        updates = ", ".join(
            f'"{c}" = EXCLUDED."{c}"' for c in _COLUMNS if c not in ("provider", "key")
        )
        params = ", ".join(f"${i}" for i in range(1, len(_COLUMNS) + 1))
        self._values_sql = (
            f'INSERT INTO "{table}" ({cols}) VALUES ({params}) '
            f"ON CONFLICT (provider, key) DO UPDATE SET {updates}"
        )
        self._merge_sql = (
            f'INSERT INTO "{table}" ({cols}) '
            f"SELECT DISTINCT ON (provider, key) {cols} "
            f'FROM "{self._stage}" ORDER BY provider, key '
            f"ON CONFLICT (provider, key) DO UPDATE SET {updates}"
        )

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise SinkError("not open", sink=self.name)
        return self._engine

    async def open(self) -> None:
        url = sa.make_url(self.config.url.get_secret_value())
        kwargs: dict[str, Any] = {"pool_pre_ping": True}  # DDL and SQLite only: rare
        try:
            if url.get_backend_name() == "sqlite":
                if url.database and url.database != ":memory:":
                    Path(url.database).parent.mkdir(parents=True, exist_ok=True)
                kwargs["connect_args"] = {"timeout": 30}
            else:
                kwargs["pool_size"] = self.config.pool_size
                kwargs["connect_args"] = {"timeout": 10, "command_timeout": self.config.timeout_s}
            self._engine = create_async_engine(url, **kwargs)
            self._upsert = self._upsert_statement()
            await self._migrate()
            if url.get_backend_name() == "postgresql":
                self._pool = await self._pg_pool()
        except Exception as exc:
            await self.aclose()
            raise SinkError(
                f"cannot prepare table {self.config.table}: {_describe(exc)}", sink=self.name
            ) from exc

    def _upsert_statement(self) -> Any:
        insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        stmt = insert(self.table)
        keys = {"provider", "key"}
        return stmt.on_conflict_do_update(
            index_elements=[self.table.c.provider, self.table.c.key],
            set_={c.name: stmt.excluded[c.name] for c in self.table.columns if c.name not in keys},
        )

    async def _migrate(self) -> None:
        schema = self._schema
        async with self._ddl_transaction() as conn:
            await conn.run_sync(self.table.metadata.create_all, checkfirst=True)
            existing = await conn.run_sync(
                lambda c: {col["name"] for col in sa.inspect(c).get_columns(self.table.name)}
            )
            for column in self.table.columns:
                if column.name not in existing:
                    ddl = sa.schema.CreateColumn(column).compile(dialect=conn.dialect)
                    await conn.execute(sa.text(f'ALTER TABLE "{self.table.name}" ADD COLUMN {ddl}'))
            version = (
                await conn.execute(
                    sa.select(schema.c.version).where(schema.c.table_name == self.table.name)
                )
            ).scalar()
            if version is None or version < _SQL_NULL_SINCE:
                await conn.execute(sa.text(_null_json_sql(conn.dialect.name, self.table.name)))
            if version is None:
                await conn.execute(
                    schema.insert().values(table_name=self.table.name, version=SCHEMA_VERSION)
                )
            if conn.dialect.name == "postgresql":
                await _prefer_lz4(conn, self.table.name)
            if version is not None and version < SCHEMA_VERSION:
                await conn.execute(
                    schema.update()
                    .where(schema.c.table_name == self.table.name)
                    .values(version=SCHEMA_VERSION)
                )

    @contextlib.asynccontextmanager
    async def _ddl_transaction(self) -> AsyncIterator[AsyncConnection]:
        """One transaction for the whole migration, serialized with every other sink and
        process migrating the same database, so a table is created exactly once."""
        if self.engine.dialect.name == "postgresql":
            async with self.engine.begin() as conn:
                await conn.execute(sa.text("SELECT pg_advisory_xact_lock(727274)"))
                yield conn
            return
        # pysqlite begins a transaction only at the first write, after the table checks: a
        # second sink could check too, then both create. BEGIN IMMEDIATE takes the write
        # lock first (waiting for it up to the busy timeout).
        async with self.engine.connect() as plain:
            conn = await plain.execution_options(isolation_level="AUTOCOMMIT")
            await conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                with contextlib.suppress(Exception):  # a broken connection: keep the cause
                    await conn.exec_driver_sql("ROLLBACK")
                raise
            await conn.exec_driver_sql("COMMIT")

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        if envelopes:
            await self._coalescer.write(envelopes)

    async def _flush(self, envelopes: list[Envelope]) -> None:
        """One transaction for every envelope of the concurrent writes gathered so far;
        :class:`SinkRejected` when the database refuses the data of some of them."""
        try:
            if self._pool is not None:
                await self._pg_upsert(envelopes)
                return
            async with self.engine.begin() as conn:
                await conn.execute(self._upsert, [_row(e) for e in envelopes])
        except SinkError:
            raise
        except Exception as exc:
            if _refuses_data(exc):
                raise SinkRejected(_describe(exc), sink=self.name) from exc
            raise SinkError(
                f"write of {len(envelopes)} rows failed: {_describe(exc)}", sink=self.name
            ) from exc

    async def _pg_upsert(self, envelopes: list[Envelope]) -> None:
        """Postgres through asyncpg: a prepared upsert for a few rows; for many, COPY into a
        temporary staging table and one INSERT ... ON CONFLICT from it."""
        if self._pool is None:
            raise SinkError("not open", sink=self.name)
        records = [_record(e) for e in envelopes]
        async with self._pool.acquire() as conn, conn.transaction():
            if len(records) < _COPY_MIN_ROWS:
                await conn.executemany(self._values_sql, records)
                return
            await conn.execute(self._stage_ddl)
            await conn.copy_records_to_table(self._stage, records=records, columns=_COLUMNS)
            await conn.execute(self._merge_sql)

    async def _pg_pool(self) -> Any:
        import asyncpg

        url = sa.make_url(self.config.url.get_secret_value()).set(drivername="postgresql")

        async def init(conn: Any) -> None:
            # jsonb in binary form is a version byte and the JSON text: orjson bytes as-is
            await conn.set_type_codec(
                "jsonb",
                schema="pg_catalog",
                format="binary",
                encoder=_jsonb,
                decoder=lambda b: orjson.loads(b[1:]),
            )

        return await asyncpg.create_pool(
            url.render_as_string(hide_password=False),
            min_size=1,
            max_size=self.config.pool_size,
            init=init,
            timeout=10,
            command_timeout=self.config.timeout_s,
        )

    async def aclose(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None


def _null_json_sql(dialect: str, table: str) -> str:
    """The JSON ``null`` an older version stored for no value, as SQL NULL: one pass."""
    literal = "'null'::jsonb" if dialect == "postgresql" else "'null'"
    sets = ", ".join(
        f'"{c}" = CASE WHEN "{c}" = {literal} THEN NULL ELSE "{c}" END' for c in _JSON_COLUMNS
    )
    where = " OR ".join(f'"{c}" = {literal}' for c in _JSON_COLUMNS)
    return f'UPDATE "{table}" SET {sets} WHERE {where}'


async def _prefer_lz4(conn: Any, table: str) -> None:
    """lz4 TOAST compression on the JSON columns: 2-2.6x faster than pglz for big bodies."""
    try:
        async with conn.begin_nested():
            for column in ("body", "metadata", "error"):
                await conn.execute(
                    sa.text(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" SET COMPRESSION lz4')
                )
    except Exception as exc:  # older server, or built without lz4: keep pglz
        log.info("lz4 compression not available for %s: %s", table, _describe(exc))


# SQLSTATE classes of a refused value: 22 data exception (out of range, bad text), 23
# integrity constraint violation; 54000 a value over a limit (e.g. index row size).
_DATA_SQLSTATES = ("22", "23", "54000")


def _refuses_data(exc: BaseException) -> bool:
    """Whether the database refused the rows' data, so the same rows fail again: a value
    the driver cannot encode or the server rejects. Connection errors and timeouts: no."""
    orig = getattr(exc, "orig", None) or exc
    if isinstance(orig, OverflowError | ValueError | orjson.JSONEncodeError):
        return True  # a number out of range, text that is not valid UTF-8, a bad timestamp
    if isinstance(orig, sqlite3.IntegrityError | sqlite3.DataError):
        return True
    sqlstate = getattr(orig, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate.startswith(_DATA_SQLSTATES)


def _describe(exc: BaseException) -> str:
    """An error's class and first line, without the SQL or connection URL."""
    orig = getattr(exc, "orig", None) or exc
    first = str(orig).splitlines()[0] if str(orig) else ""
    return f"{type(orig).__name__}: {first}"[:300]
