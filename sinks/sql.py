"""The ``sql`` sink: one row per result in Postgres (asyncpg) or SQLite (aiosqlite).

The table has a column for every envelope field (from :data:`nopoll.envelope.COLUMNS`),
primary key ``(provider, key, tenant)``; every write is an upsert. The sink creates and
migrates its own table under a lock (additive columns, a recorded schema version). Empty
fields are SQL NULL; on Postgres every NUL character is stored as U+FFFD
(:mod:`sinks._postgres`). A row the database refuses fails alone
(:class:`~nopoll.exceptions.SinkRowsRejected`); any other failure is a
:class:`~nopoll.exceptions.SinkError` for the whole write.

See docs/sinks/sql.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import re
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from pydantic import SecretStr, field_validator
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlmodel import Field, SQLModel

from nopoll.envelope import COLUMNS, PRIMARY_KEY, Column, Envelope
from nopoll.exceptions import SinkError, SinkRejected
from nopoll.wire import url_origin
from sinks._postgres import COPY_MIN_ROWS, PostgresWriter, parse_time
from sinks.base import SinkBase, SinkConfig
from sinks.coalesce import WriteCoalescer

__all__ = ["SCHEMA_VERSION", "NopollResult", "SqlSink", "SqlSinkConfig", "results_table"]

log = logging.getLogger("nopoll.sinks.sql")

SCHEMA_VERSION = 3
"""1: the first table. 2: JSON columns hold SQL NULL for no value, never JSON ``null``.
3: the primary key is ``(provider, key, tenant)``."""
_JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
_TYPES: dict[str, Callable[[], sa.types.TypeEngine[Any]]] = {
    "text": sa.String,
    "integer": sa.Integer,
    "boolean": sa.Boolean,
    "json": lambda: _JSON,
    "timestamp": lambda: sa.DateTime(timezone=True),
}
_PY_TYPES: dict[str, Any] = {
    "text": str,
    "integer": int,
    "boolean": bool,
    "json": dict[str, Any],
    "timestamp": datetime,
}
_JSON_COLUMNS = tuple(c.name for c in COLUMNS if c.type == "json")
_TIME_COLUMNS = tuple(c.name for c in COLUMNS if c.type == "timestamp")
_SQL_NULL_SINCE = 2  # the schema version from which no value is SQL NULL
_TENANT_KEY_SINCE = 3  # the schema version from which the tenant is in the primary key
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_UPSERT_AFTER_CONFLICT = 8
"""Batch chunks upserted straight away after one whose plain ``COPY`` met a key already
stored: a resumed batch meets them chunk after chunk, and each failed ``COPY`` is work lost."""


def _result_model() -> type[SQLModel]:
    """``NopollResult``: the results table as a sqlmodel class, generated from the
    envelope's columns (its ``metadata`` field is the attribute ``meta``: SQLModel keeps
    ``metadata`` for itself)."""
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {"__tablename__": "nopoll_results"}
    for c in sorted(COLUMNS, key=_key_first):
        attr = "meta" if c.name == "metadata" else c.name
        annotations[attr] = _PY_TYPES[c.type] | None if c.nullable else _PY_TYPES[c.type]
        namespace[attr] = Field(
            default=c.default,
            sa_column=sa.Column(
                c.name,
                _TYPES[c.type](),
                primary_key=c.name in PRIMARY_KEY,
                nullable=c.nullable,
                default=c.default,
            ),
        )
    namespace["__annotations__"] = annotations
    model: type[SQLModel] = type("NopollResult", (SQLModel,), namespace, table=True)
    return model


def _key_first(c: Column) -> int:
    """Primary key columns first, in its order (as every version made them)."""
    return PRIMARY_KEY.index(c.name) if c.name in PRIMARY_KEY else len(PRIMARY_KEY)


NopollResult = _result_model()
"""One result row, as a sqlmodel table class (column names and meanings are the envelope's)."""


def results_table(name: str) -> sa.Table:
    """The results table under ``name``, in a metadata of its own: a column for every
    envelope field (:data:`nopoll.envelope.COLUMNS`), the primary key ``(provider, key,
    tenant)`` first, then the others in the envelope's order."""
    table: sa.Table = NopollResult.__table__.to_metadata(sa.MetaData(), name=name)  # type: ignore[attr-defined]
    return table


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

    def rebased(self, base: Path) -> SqlSinkConfig:
        """A SQLite file given by a relative path (``sqlite:///nopoll-data/results.db``)
        made absolute under ``base``."""
        url = self.url.get_secret_value()
        prefix = "sqlite+aiosqlite:///"
        path = url.removeprefix(prefix)
        if path == url or not path or path.startswith(("/", ":memory:", "?")):
            return self
        return self.model_copy(update={"url": SecretStr(f"{prefix}{base / path}")})

    def location(self) -> str:
        """``SQLite file <absolute path>``, or the database URL's origin (no password)."""
        url = self.url.get_secret_value()
        path = _sqlite_file(url)
        return f"SQLite file {path}" if path is not None else url_origin(url)

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


def _sqlite_file(url: str) -> str | None:
    """The absolute path of a SQLite URL's file (None: not a SQLite file URL). A relative
    path (``sqlite:///nopoll-data/results.db``) is relative to the folder nopoll runs in."""
    scheme, sep, rest = url.partition(":///")
    if not sep or not scheme.startswith("sqlite") or not rest or rest.startswith(":memory:"):
        return None
    return str(Path(rest.partition("?")[0]).absolute())


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _row(env: Envelope) -> dict[str, Any]:
    """A row for SQLAlchemy (SQLite): the envelope's fields, times as datetimes."""
    row = env.to_dict()
    for name in _TIME_COLUMNS:
        row[name] = parse_time(row[name])
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
        self._postgres: PostgresWriter | None = None
        """Writes on Postgres (asyncpg); None on SQLite, where SQLAlchemy writes."""
        self._coalescer = WriteCoalescer(self._flush)
        self._upserts_left = 0
        """Batch chunks still to upsert without trying a plain ``COPY`` first."""

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
                self._postgres = PostgresWriter(self.config.table)
                dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
                await self._postgres.open(
                    dsn, pool_size=self.config.pool_size, timeout_s=self.config.timeout_s
                )
        except BaseException as exc:  # cancelled too: close what was opened so far
            await asyncio.shield(self.aclose())
            if not isinstance(exc, Exception):
                raise
            raise SinkError(
                f"cannot prepare table {self.config.table}: {_describe(exc)}", sink=self.name
            ) from exc

    def _upsert_statement(self) -> Any:
        insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        stmt = insert(self.table)
        return stmt.on_conflict_do_update(
            index_elements=[self.table.c[name] for name in PRIMARY_KEY],
            set_={
                c.name: stmt.excluded[c.name]
                for c in self.table.columns
                if c.name not in PRIMARY_KEY
            },
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
            if version is None or version < _TENANT_KEY_SINCE:
                await _rekey(conn, self.table)
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

    async def write_batch_part(self, part: int, envelopes: Sequence[Envelope]) -> None:
        """A batch chunk: on Postgres, copied (``COPY``) straight into the table while its keys
        are new (:meth:`PostgresWriter.insert_new`); an upsert (:meth:`write`) when one of
        them is there already, and for the next :data:`_UPSERT_AFTER_CONFLICT` chunks (a
        resumed batch rewrites rows it wrote before), for a small chunk, on SQLite, and
        when the database refuses some row's data (the upsert finds which)."""
        postgres = self._postgres
        if postgres is None or len(envelopes) < COPY_MIN_ROWS or self._upserts_left > 0:
            self._upserts_left = max(0, self._upserts_left - 1)
            await self.write(envelopes)
            return
        try:
            if await postgres.insert_new(envelopes):
                return
            self._upserts_left = _UPSERT_AFTER_CONFLICT
        except Exception as exc:
            if not _refuses_data(exc):
                raise SinkError(
                    f"write of {len(envelopes)} rows failed: {_describe(exc)}", sink=self.name
                ) from exc
        await self.write(envelopes)

    async def _flush(self, envelopes: list[Envelope]) -> None:
        """One transaction for every envelope of the concurrent writes gathered so far;
        :class:`SinkRejected` when the database refuses the data of some of them."""
        try:
            if self._postgres is not None:
                await self._postgres.write(envelopes)
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

    async def aclose(self) -> None:
        if self._postgres is not None:
            postgres, self._postgres = self._postgres, None
            await postgres.aclose()
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


async def _rekey(conn: AsyncConnection, table: sa.Table) -> None:
    """A table made before tenants had rows of their own gets the primary key
    :data:`~nopoll.envelope.PRIMARY_KEY`: in place on Postgres; SQLite cannot change a
    primary key, so there the table is copied into a new one (in the same transaction)."""
    pk = await conn.run_sync(lambda c: sa.inspect(c).get_pk_constraint(table.name))
    if list(pk.get("constrained_columns") or ()) == list(PRIMARY_KEY):
        return
    name, keys = table.name, ", ".join(f'"{c}"' for c in PRIMARY_KEY)
    log.info("table %s: primary key becomes (%s)", name, ", ".join(PRIMARY_KEY))
    if conn.dialect.name == "postgresql":
        drop = f'DROP CONSTRAINT "{pk["name"]}", ' if pk.get("name") else ""
        await conn.execute(sa.text(f'ALTER TABLE "{name}" {drop}ADD PRIMARY KEY ({keys})'))
        return
    old, cols = f"{name}__nopoll_rekey", ", ".join(f'"{c.name}"' for c in table.columns)
    await conn.execute(sa.text(f'ALTER TABLE "{name}" RENAME TO "{old}"'))
    await conn.run_sync(table.create)
    await conn.execute(sa.text(f'INSERT INTO "{name}" ({cols}) SELECT {cols} FROM "{old}"'))
    await conn.execute(sa.text(f'DROP TABLE "{old}"'))


async def _prefer_lz4(conn: Any, table: str) -> None:
    """lz4 TOAST compression on the JSON columns and ``output_text`` (the columns a big
    answer fills): 2-2.6x faster than pglz for big bodies (Postgres 14 and later)."""
    try:
        async with conn.begin_nested():
            for column in (*_JSON_COLUMNS, "output_text"):
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
