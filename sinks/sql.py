"""The ``sql`` sink: one row per result in Postgres (asyncpg) or SQLite (aiosqlite).

The table (``nopoll_results`` by default) has the envelope's columns with primary key
``(provider, key)``; every write is an upsert, so replays never duplicate. The sink
creates and migrates its own table (additive columns, a recorded schema version).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import SecretStr, field_validator
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlmodel import Column, Field, SQLModel

from receiver.envelope import Envelope
from receiver.exceptions import SinkError
from sinks.base import SinkBase, SinkConfig

__all__ = ["SCHEMA_VERSION", "NopollResult", "SqlSink", "SqlSinkConfig", "results_table"]

SCHEMA_VERSION = 1
_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
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
        return value

    @field_validator("table")
    @classmethod
    def _table(cls, value: str) -> str:
        if not _IDENT.match(value):
            raise ValueError("must be a plain SQL identifier ([A-Za-z_][A-Za-z0-9_]*)")
        return value


def _parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


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
        self._engine: AsyncEngine | None = None
        self._upsert: Any = None

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise SinkError("not open", sink=self.name)
        return self._engine

    async def open(self) -> None:
        url = sa.make_url(self.config.url.get_secret_value())
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
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
        schema = _schema_table(self.table.metadata)
        async with self.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # Several workers may start at once; serialize their DDL.
                await conn.execute(sa.text("SELECT pg_advisory_xact_lock(727274)"))
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
            if version is None:
                await conn.execute(
                    schema.insert().values(table_name=self.table.name, version=SCHEMA_VERSION)
                )
            elif version < SCHEMA_VERSION:
                await conn.execute(
                    schema.update()
                    .where(schema.c.table_name == self.table.name)
                    .values(version=SCHEMA_VERSION)
                )

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        if not envelopes:
            return
        rows = [_row(e) for e in envelopes]
        try:
            async with self.engine.begin() as conn:
                await conn.execute(self._upsert, rows)
        except Exception as exc:
            raise SinkError(
                f"write of {len(rows)} rows failed: {_describe(exc)}", sink=self.name
            ) from exc

    async def aclose(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None


def _describe(exc: BaseException) -> str:
    """An error's class and first line, without the SQL or connection URL."""
    orig = getattr(exc, "orig", None) or exc
    first = str(orig).splitlines()[0] if str(orig) else ""
    return f"{type(orig).__name__}: {first}"[:300]
