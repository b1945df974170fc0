"""Every built-in sink through the same cases: write, rewrite, read back, failure.

Real backends: SQLite files, the machine's Postgres, the local filesystem, a webhook
subscriber under uvicorn (``http``), moto's S3 server (``s3``) and a tansu broker
(``kafka``). Each sink is read back through its real destination: the subscriber's
verified deliveries, the bucket's objects, the topic's messages.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import boto3
import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkError
from sinks.registry import BUILTIN_SINKS, create_sink, validate_sink_config
from tests.servers import free_port
from tests.sinks.helpers import Backend, PostgresBackend, SqliteBackend, envelope, normalize_row
from tests.subscriber import Subscriber


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


class HttpBackend(Backend):
    """Read back from the subscriber the sink posts to: every delivery verified."""

    idempotent = False  # at least once: a replay is delivered again, same webhook-id

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.subscriber = Subscriber(secret)

    async def start(self) -> None:
        await self.subscriber.start()

    async def stop(self) -> None:
        await self.subscriber.stop()

    def config(self) -> dict[str, Any]:
        return {"type": "http", "url": self.subscriber.url(), "secret": self.secret}

    async def read(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for delivery in self.subscriber.deliveries:
            assert delivery.verified
            payload = delivery.payload
            rows += payload if isinstance(payload, list) else [payload]
        return rows

    def broken_config(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens here
        return {"type": "http", "url": url, "secret": self.secret, "timeout_s": 3}


class S3Backend(Backend):
    """Read back every object in the bucket with a plain boto3 client."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.bucket = f"nopoll-test-{uuid.uuid4().hex[:12]}"

    def config(self) -> dict[str, Any]:
        return {
            "type": "s3",
            "bucket": self.bucket,
            "prefix": "nopoll/",
            "endpoint_url": self.endpoint,
            "create_bucket": True,
            "timeout_s": 10,
        }

    async def read(self) -> list[dict[str, Any]]:
        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
        try:
            rows = []
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
            for key in sorted(obj["Key"] for page in pages for obj in page.get("Contents", ())):
                assert key.startswith("nopoll/sim/responses/")  # one provider, responses only
                rows.append(json.loads(s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()))
            return rows
        except s3.exceptions.NoSuchBucket:  # nothing written, nothing created
            return []
        finally:
            s3.close()

    def broken_config(self) -> dict[str, Any]:
        endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens here
        return {**self.config(), "endpoint_url": endpoint, "timeout_s": 3, "max_attempts": 1}


class KafkaBackend(Backend):
    """Read back the topic (three partitions) with a plain consumer, up to its end offsets."""

    idempotent = False  # at least once: a replay is sent again, same message key
    partitions = 3

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.topic = f"nopoll.test.{uuid.uuid4().hex[:12]}"

    async def start(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            topic = NewTopic(self.topic, num_partitions=self.partitions, replication_factor=1)
            await admin.create_topics([topic])
        finally:
            await admin.close()

    def config(self) -> dict[str, Any]:
        return {
            "type": "kafka",
            "bootstrap_servers": self.bootstrap,
            "topic": self.topic,
            "enable_idempotence": False,  # tansu lacks idempotent producers
            "timeout_s": 10,
        }

    async def read(self) -> list[dict[str, Any]]:
        """Every message, partition by partition in offset order (a key's copies in the
        order they were sent)."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False, group_id=None
        )
        await consumer.start()
        try:
            tps = [TopicPartition(self.topic, p) for p in range(self.partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            records: dict[TopicPartition, list[Any]] = {tp: [] for tp in tps}
            deadline = time.monotonic() + 20
            while [await consumer.position(tp) for tp in tps] < [ends[tp] for tp in tps]:
                assert time.monotonic() < deadline, "the topic was not read to its end"
                for tp, batch in (await consumer.getmany(*tps, timeout_ms=500)).items():
                    records[tp].extend(batch)
        finally:
            await consumer.stop()
        return [orjson.loads(r.value) for tp in tps for r in records[tp]]

    def broken_config(self) -> dict[str, Any]:
        servers = f"127.0.0.1:{free_port()}"  # nothing listens here
        return {**self.config(), "bootstrap_servers": servers, "timeout_s": 3}


# every built-in sink type, SQL twice (SQLite and Postgres)
BACKENDS = ["sqlite", "postgres", "jsonl", "http", "s3", "kafka"]


def test_every_builtin_sink_type_is_in_the_contract() -> None:
    assert {"sql" if b in ("sqlite", "postgres") else b for b in BACKENDS} == set(BUILTIN_SINKS)


@pytest.fixture(params=BACKENDS)
def _backend(request, tmp_path: Path) -> Backend:
    """The backend, not started: its servers' fixtures are resolved here, outside the loop."""
    if request.param == "sqlite":
        return SqliteBackend(tmp_path)
    if request.param == "jsonl":
        return JsonlBackend(tmp_path)
    if request.param == "postgres":
        return PostgresBackend(
            request.getfixturevalue("pg_url"), request.getfixturevalue("pg_table")
        )
    if request.param == "s3":
        return S3Backend(request.getfixturevalue("s3_endpoint"))
    if request.param == "kafka":
        return KafkaBackend(request.getfixturevalue("kafka_bootstrap"))
    return HttpBackend(request.getfixturevalue("webhook_secret"))


@pytest.fixture
async def backend(_backend: Backend) -> AsyncIterator[Backend]:
    await _backend.start()
    try:
        yield _backend
    finally:
        await _backend.stop()


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
    else:
        assert keys == ["resp_1", "resp_1", "resp_2"]
    # read in order, the last copy of a key is the latest
    assert {r["key"]: r["output_text"] for r in rows}["resp_1"] == "second"


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
    """Batch-sized writes (COPY → staging → upsert on Postgres) keep one row per key (an
    at-least-once sink: every copy, the latest read last)."""
    sink = await sink_of()
    first = [envelope(i, "v1") for i in range(300)]
    await sink.write(first)
    await sink.write([envelope(i, "v2") for i in range(150, 450)])
    read = await backend.read()
    assert len(read) == (450 if backend.idempotent else 600)
    rows = {r["key"]: normalize_row(r) for r in read}
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
