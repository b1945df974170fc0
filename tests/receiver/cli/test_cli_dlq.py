"""``nopoll dlq list`` and ``nopoll dlq replay`` on a real Redis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from receiver.cli import main
from receiver.queue._arq import arq_pool
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import JOBS_QUEUE
from receiver.redis import RedisConnector
from tests.dead_letters import keep_letter


def config(tmp_path: Path, redis_url: str) -> str:
    path = tmp_path / "nopoll.yaml"
    path.write_text(f"redis_url: '{redis_url}'\ndata_dir: {tmp_path / 'data'}\n")
    return str(path)


async def add_letters(redis_url: str) -> None:
    pool = arq_pool(RedisConnector.from_url(redis_url))
    letters = DeadLetters(pool)
    delivery = {"sink": "warehouse", "envelopes": [], "part": None}
    error = "sink 'warehouse': ConnectionRefusedError"
    await keep_letter(
        letters, "deliver", "warehouse", ["resp_a"], delivery, attempts=12, error=error
    )
    fetch = {
        "provider": "sim",
        "response_id": "resp_b",
        "event_id": None,
        "received_at": "2026-01-01T00:00:00.000Z",
        "tenant": "default",
    }
    error = "sim GET responses/resp_b (HTTP 500)"
    await keep_letter(
        letters, "fetch_response", "fetch", ["resp_b"], fetch, attempts=8, error=error
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
    assert "1 dead letter(s) queued again in" in capsys.readouterr().out
    assert len(redis_sync_client.zrange(JOBS_QUEUE, 0, -1)) == 1
    assert main(["dlq", "replay", "--config", cfg]) == 0  # no selector: every one left
    assert "1 dead letter(s) queued again in" in capsys.readouterr().out
    assert main(["dlq", "list", "--config", cfg]) == 0
    assert f"no dead letters in {redis_url}" in capsys.readouterr().out
    assert len(redis_sync_client.zrange(JOBS_QUEUE, 0, -1)) == 2


# --- the installed command, as a new user runs it ---------------------------------------

NOPOLL = str(Path(sys.executable).parent / "nopoll")


def bare_env(**extra: str) -> dict[str, str]:
    """Only what any shell has: no NOPOLL_* variable, no provider secret."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")  # the code under test
    return {**{k: os.environ[k] for k in keep if k in os.environ}, **extra}


def nopoll(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [NOPOLL, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def test_list_without_config_in_an_empty_folder_refuses_and_creates_nothing(tmp_path):
    result = nopoll("dlq", "list", cwd=tmp_path, env=bare_env())
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no dead letters" not in result.stdout
    err = result.stderr
    assert "no config" in err
    assert str(tmp_path / "nopoll-data") in err  # where it would look
    assert "--config" in err and "NOPOLL_CONFIG" in err
    assert list(tmp_path.iterdir()) == []  # no ./nopoll-data for a read-only command


def test_list_without_config_uses_a_running_embedded_redis_and_says_so(tmp_path):
    from receiver.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "nopoll-data")
    url = server.start()
    try:
        result = nopoll("dlq", "list", cwd=tmp_path, env=bare_env())
    finally:
        server.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"no dead letters in the embedded Redis at {url}" in result.stdout


def test_list_says_which_redis_and_needs_no_secret(tmp_path, redis_url):
    asyncio.run(add_letters(redis_url))
    cfg = tmp_path / "nopoll.yaml"
    cfg.write_text(
        f"redis_url: '{redis_url}'\n"
        f"data_dir: {tmp_path / 'data'}\n"
        "providers:\n"
        "  sference:\n"
        "    dialect: sference\n"
        "    base_url: https://api.sference.com/v1\n"
        "    api_key: ${SFERENCE_API_KEY}\n"
        '    webhook_secrets: ["${SFERENCE_WEBHOOK_SECRET}"]\n'
    )
    result = nopoll("dlq", "list", "--config", str(cfg), cwd=tmp_path, env=bare_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"2 dead letter(s) in {redis_url}" in result.stdout
    assert "SFERENCE_API_KEY is not set (needed to run)" in result.stderr
    assert not (tmp_path / "data").exists()
    # replay changes things: it still wants the whole config
    replay = nopoll("dlq", "replay", "--config", str(cfg), cwd=tmp_path, env=bare_env())
    assert replay.returncode == 2
    assert "SFERENCE_API_KEY is not set" in replay.stderr


def test_list_with_an_unset_redis_url_says_so(tmp_path):
    cfg = tmp_path / "nopoll.yaml"
    cfg.write_text("redis_url: ${REDIS_URL}\n")
    result = nopoll("dlq", "list", "--config", str(cfg), cwd=tmp_path, env=bare_env())
    assert result.returncode == 2, result.stdout + result.stderr
    assert "redis_url" in result.stderr and "REDIS_URL is not set" in result.stderr
    assert list(tmp_path.iterdir()) == [cfg]


def test_list_with_an_embedded_config_and_no_data_refuses(tmp_path):
    cfg = tmp_path / "nopoll.yaml"
    cfg.write_text("data_dir: ./elsewhere\n")
    result = nopoll("dlq", "list", "--config", str(cfg), cwd=tmp_path, env=bare_env())
    assert result.returncode == 2, result.stdout + result.stderr
    assert str(tmp_path / "elsewhere") in result.stderr
    assert list(tmp_path.iterdir()) == [cfg]


def test_list_of_a_sink_that_does_not_exist_says_so_and_names_the_sinks(tmp_path, redis_url):
    asyncio.run(add_letters(redis_url))
    cfg = config(tmp_path, redis_url)  # the built-in sinks: db and files
    result = nopoll(
        "dlq", "list", "--config", cfg, "--sink", "nosuch", cwd=tmp_path, env=bare_env()
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no dead letters" not in result.stdout
    assert "no such sink 'nosuch': dead letters belong to one of db, files, fetch, watch" in (
        result.stderr
    )
    # a sink no longer in the config keeps its letters, and they are listed
    kept = nopoll(
        "dlq", "list", "--config", cfg, "--sink", "warehouse", cwd=tmp_path, env=bare_env()
    )
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "resp_a" in kept.stdout
    # a configured sink without letters has none, and says so
    empty = nopoll("dlq", "list", "--config", cfg, "--sink", "db", cwd=tmp_path, env=bare_env())
    assert empty.returncode == 0 and "no dead letters" in empty.stdout
