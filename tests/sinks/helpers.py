"""Helpers shared by several sink test modules and the e2e fan-out tests."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import asyncpg
import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer

from nopoll.envelope import Envelope, envelope_from_response
from receiver.demo.simulator import make_response
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

    async def start(self) -> None:
        """Make the destination ready (start a subscriber, create a topic)."""

    async def stop(self) -> None:
        """Stop what :meth:`start` started."""

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


def normalize_row(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for col in ("received_at", "fetched_at"):
        value = out[col]
        if not isinstance(value, str):
            out[col] = value.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        elif "T" not in value:  # SQLite stores "2026-11-29 10:00:00.123000+00:00"
            out[col] = value.replace(" ", "T")[:23] + "Z"
    return out


async def consume(bootstrap: str, topic: str, expected: int, timeout_s: float = 20) -> list[Any]:
    """Every message of ``topic`` from the beginning, until ``expected`` have arrived."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=None,
    )
    await consumer.start()
    messages: list[Any] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(messages) < expected and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                messages.extend(records)
    finally:
        await consumer.stop()
    return messages
