from __future__ import annotations

import base64
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis as redis_sync
from standardwebhooks.webhooks import Webhook

from receiver.config.settings import Settings, load_settings
from receiver.demo.simulator import ProviderSimulator
from tests.kafka_broker import kafka_bootstrap, tansu_bin  # noqa: F401 - fixtures
from tests.s3_server import s3_endpoint, s3_server  # noqa: F401 - fixtures
from tests.servers import ValkeyProcess, missing

REDIS_DB = 1  # the suite's own database on the shared Redis; flushed before every test


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NOPOLL_* or AWS_* variable from the developer's shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith(("NOPOLL_", "AWS_")) and not name.startswith("NOPOLL_TEST_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def _redis_base_url() -> Iterator[str]:
    url = os.environ.get("NOPOLL_TEST_REDIS_URL", f"redis://127.0.0.1:6379/{REDIS_DB}")
    probe = redis_sync.Redis.from_url(url, socket_connect_timeout=1)
    try:
        probe.ping()
        reachable = True
    except redis_sync.RedisError:
        reachable = False
    finally:
        # closed at once, not left to the collector (see the ResourceWarning filters)
        probe.close()
    if reachable:
        yield url
        return
    # No Redis on this machine: run the embedded valkey binary for the session.
    server = ValkeyProcess().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_url(_redis_base_url: str) -> str:
    """A real, empty Redis database."""
    client = redis_sync.Redis.from_url(_redis_base_url)
    try:
        client.flushdb()
    finally:
        client.close()
    return _redis_base_url


@pytest.fixture
def redis_sync_client(redis_url: str) -> Iterator[redis_sync.Redis]:
    client = redis_sync.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def _postgres_ok() -> str | None:
    import asyncio

    import asyncpg

    url = os.environ.get("NOPOLL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")

    async def probe() -> None:
        conn = await asyncpg.connect(url, timeout=3)
        await conn.close()

    try:
        asyncio.run(probe())
    except Exception as exc:
        return f"PostgreSQL not reachable at {url}: {exc}"
    return None


@pytest.fixture
def pg_url(_postgres_ok: str | None) -> str:
    """A real Postgres database URL (the machine's; .ci/run starts it if needed)."""
    if _postgres_ok is not None:
        missing(_postgres_ok)
    return os.environ.get("NOPOLL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture
def pg_table(_postgres_ok: str | None) -> Iterator[str]:
    """A fresh table name, so tests never see each other's rows; the table (and its
    ``nopoll_schema`` row) is dropped after the test, so the test database stays clean."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    yield name
    if _postgres_ok is None:
        _drop_pg_table(name)


def _drop_pg_table(name: str) -> None:
    import asyncio
    import threading

    import asyncpg

    url = os.environ.get("NOPOLL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")

    async def drop() -> None:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            await conn.execute(f'DROP TABLE IF EXISTS "{name}", "{name}__nopoll_rekey" CASCADE')
            if await conn.fetchval("SELECT to_regclass('nopoll_schema')") is not None:
                await conn.execute("DELETE FROM nopoll_schema WHERE table_name = $1", name)
        finally:
            await conn.close()

    # in a thread of its own: an async test's event loop may still be set on this one
    worker = threading.Thread(target=asyncio.run, args=(drop(),))
    worker.start()
    worker.join(30)


@pytest.fixture
def provider_sim() -> Iterator[Callable[..., ProviderSimulator]]:
    """Factory: a started provider simulator (a real HTTP server on 127.0.0.1)."""
    started: list[ProviderSimulator] = []

    def make(**kwargs: Any) -> ProviderSimulator:
        sim = ProviderSimulator(**kwargs).start()
        started.append(sim)
        return sim

    yield make
    for sim in started:
        sim.stop()


@pytest.fixture
def limited_sim() -> Iterator[Callable[..., Any]]:
    """Factory: a started :class:`~tests.limited_provider.LimitedSimulator` (the provider
    simulator behind a rate-limit layer: X-RateLimit-* headers, 429s, a request log)."""
    from tests.limited_provider import LimitedSimulator

    started: list[LimitedSimulator] = []

    def make(**kwargs: Any) -> LimitedSimulator:
        sim = LimitedSimulator(**kwargs)
        sim.start()
        started.append(sim)
        return sim

    yield make
    for sim in started:
        sim.stop()


@pytest.fixture
def webhook_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


SignedCallback = Callable[..., tuple[bytes, dict[str, str]]]


@pytest.fixture
def signed_callback(webhook_secret: str) -> SignedCallback:
    """Factory: (body, headers) of a callback signed by the standardwebhooks package."""

    def make(
        object_id: str = "resp_abc123",
        *,
        event_type: str = "response.completed",
        msg_id: str | None = None,
        secret: str | bytes | None = None,
        timestamp: int | None = None,
        body: bytes | None = None,
    ) -> tuple[bytes, dict[str, str]]:
        msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
        ts = int(time.time()) if timestamp is None else timestamp
        if body is None:
            body = orjson.dumps(
                {
                    "id": f"evt_{uuid.uuid4().hex}",
                    "type": event_type,
                    "created_at": ts,
                    "data": {"id": object_id},
                }
            )
        signer = Webhook(secret if secret is not None else webhook_secret)
        signature = signer.sign(msg_id, datetime.fromtimestamp(ts, tz=UTC), body.decode())
        return body, {
            "webhook-id": msg_id,
            "webhook-timestamp": str(ts),
            "webhook-signature": signature,
            "content-type": "application/json",
        }

    return make


@pytest.fixture
def make_settings(tmp_path: Path, webhook_secret: str) -> Callable[..., Settings]:
    """Factory: validated Settings with one provider ``sim`` and fast retries."""

    def make(
        base_url: str = "http://127.0.0.1:9/v1",
        *,
        redis_url: str = "",
        sinks: dict[str, Any] | None = None,
        secrets_: list[str] | None = None,
        **overrides: Any,
    ) -> Settings:
        raw: dict[str, Any] = {
            "redis_url": redis_url,
            "data_dir": str(tmp_path / "data"),
            "providers": {
                "sim": {
                    "dialect": "openai",
                    "base_url": base_url,
                    "api_key": "sk-test-not-a-real-key",
                    "webhook_secrets": secrets_ or [webhook_secret],
                }
            },
            "sinks": sinks or {"files": {"type": "jsonl", "dir": str(tmp_path / "results")}},
            "fetch_retry": {"max_tries": 3, "base_delay_s": 0.05, "max_delay_s": 0.2},
            "sink_retry": {"max_tries": 40, "base_delay_s": 0.05, "max_delay_s": 0.25},
            "http": {"attempts": 2, "connect_timeout_s": 2, "read_timeout_s": 5},
            "worker": {"poll_delay_s": 0.01, "health_check_interval_s": 1, "shutdown_wait_s": 2},
        }
        raw.update(overrides)
        return load_settings(None, env={}, overrides=raw)

    return make
