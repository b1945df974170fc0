"""``nopoll dlq list`` and ``nopoll dlq replay`` on a real Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

from receiver.cli import main
from receiver.deadletter import DeadLetters
from receiver.queue import JOBS_QUEUE, arq_pool


def config(tmp_path: Path, redis_url: str) -> str:
    path = tmp_path / "nopoll.yaml"
    path.write_text(f"redis_url: '{redis_url}'\ndata_dir: {tmp_path / 'data'}\n")
    return str(path)


async def add_letters(redis_url: str) -> None:
    pool = arq_pool(redis_url)
    letters = DeadLetters(pool)
    await letters.add(
        sink="warehouse",
        provider="sim",
        keys=["resp_a"],
        attempts=12,
        error="sink 'warehouse': ConnectionRefusedError",
        function="deliver",
        kwargs={"sink": "warehouse", "envelopes": [], "part": None},
    )
    await letters.add(
        sink="fetch",
        provider="sim",
        keys=["resp_b"],
        attempts=8,
        error="sim GET responses/resp_b (HTTP 500)",
        function="fetch_response",
        kwargs={
            "provider": "sim",
            "response_id": "resp_b",
            "event_id": None,
            "received_at": "2026-01-01T00:00:00.000Z",
            "tenant": "default",
        },
    )
    await pool.aclose()


def test_list_and_replay(tmp_path, redis_url, redis_sync_client, capsys):
    asyncio.run(add_letters(redis_url))
    cfg = config(tmp_path, redis_url)
    assert main(["dlq", "list", "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert "resp_a" in out and "resp_b" in out and "2 dead letter(s)" in out
    assert "ConnectionRefusedError" in out and "HTTP 500" in out
    assert main(["dlq", "list", "--config", cfg, "--sink", "fetch"]) == 0
    out = capsys.readouterr().out
    assert "resp_b" in out and "resp_a" not in out

    assert main(["dlq", "replay", "--config", cfg, "--sink", "fetch"]) == 0
    assert "1 dead letter(s) queued again" in capsys.readouterr().out
    assert len(redis_sync_client.zrange(JOBS_QUEUE, 0, -1)) == 1
    assert main(["dlq", "replay", "--config", cfg]) == 0  # no selector: every one left
    assert "1 dead letter(s) queued again" in capsys.readouterr().out
    assert main(["dlq", "list", "--config", cfg]) == 0
    assert "no dead letters" in capsys.readouterr().out
    assert len(redis_sync_client.zrange(JOBS_QUEUE, 0, -1)) == 2
