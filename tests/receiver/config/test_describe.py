"""The start-up summary's sink lines: each sink config's ``location()``, no secret shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from receiver.config.describe import describe
from receiver.config.settings import load_settings
from receiver.redis.connector import RedisConnector

SECRET = "whsec_QUJDREVGR0hJSktMTU5PUA=="


def sink_lines(sinks: dict[str, dict[str, object]]) -> list[str]:
    settings = load_settings(None, env={}, overrides={"data_dir": "data", "sinks": sinks})
    lines = describe(
        settings, RedisConnector.from_url("redis://127.0.0.1:6379/0"), api=None, worker=True
    )
    return [line for line in lines if line.startswith("sink ")]


def test_every_builtin_sink_says_where_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sinks: dict[str, dict[str, object]] = {
        "rel": {"type": "sql", "url": "sqlite:///nopoll-data/results.db"},
        "abs": {"type": "sql", "url": "sqlite:////srv/x/results.db?mode=rwc"},
        "mem": {"type": "sql", "url": "sqlite:///:memory:"},
        "pg": {"type": "sql", "url": "postgresql://u:hunter2@db.example:5432/prod?sslmode=x"},
        "files": {"type": "jsonl", "dir": "out/results"},
        "hook": {
            "type": "http",
            "url": "https://c.example:8443/hook/tok?token=abc",
            "secret": SECRET,
        },
        "lake": {
            "type": "s3",
            "bucket": "llm-results",
            "endpoint_url": "http://minio:9000",
            "secret_access_key": "shh-secret",
            "access_key_id": "AKIA",
        },
        "bus": {"type": "kafka", "bootstrap_servers": "k1:9092, k2:9092", "topic": "t"},
        "url_bus": {"type": "kafka", "bootstrap_servers": "SASL_SSL://u:pw@k1:9093", "topic": "t"},
    }
    assert sink_lines(sinks) == [
        f"sink rel: sql -> SQLite file {tmp_path / 'nopoll-data' / 'results.db'}",
        "sink abs: sql -> SQLite file /srv/x/results.db",
        "sink mem: sql -> sqlite+aiosqlite:///:memory:",
        "sink pg: sql -> postgresql+asyncpg://db.example:5432",
        f"sink files: jsonl -> {tmp_path / 'out' / 'results'}",
        "sink hook: http -> https://c.example:8443",
        "sink lake: s3 -> llm-results",
        "sink bus: kafka -> k1:9092,k2:9092",
        "sink url_bus: kafka -> ***",
    ]
    text = "\n".join(sink_lines(sinks))
    for secret in ("hunter2", "tok", "abc", "shh-secret", "pw"):
        assert secret not in text
