"""nopoll as users run it: separate processes, killed and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.helpers import (
    await_ready,
    pg_rows,
    queues_empty,
    requested,
    wait_for,
    wait_ready,
    write_config,
)
from tests.servers import free_port, running_api

pytestmark = pytest.mark.slow


async def test_worker_sigkilled_mid_job_runs_it_again_exactly_one_row(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, signed_callback, make_settings
):
    sim = provider_sim()
    slow = sim.add_response("resp_kill", delay_s=1.5)
    config = write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        sinks=f"  db: {{type: sql, url: '{pg_url}', table: {pg_table}}}\n",
    )
    worker = procs.start("worker", "--config", str(config))
    settings = make_settings(sim.base_url, redis_url=redis_url)
    async with running_api(settings, redis_url) as (base, _), httpx.AsyncClient() as client:
        body, headers = signed_callback("resp_kill")
        r = await client.post(f"{base}/webhooks/sim", content=body, headers=headers)
        assert r.status_code == 202

    await wait_for(requested(sim, "/v1/responses/resp_kill"), timeout=20)
    worker.send_signal(signal.SIGKILL)  # mid-job: the provider has not answered yet
    worker.wait(10)
    slow.delay_s = 0
    procs.start("worker", "--config", str(config))
    # arq re-runs it once the dead worker's in-progress lock (job timeout + 10 s) expires
    await wait_for(lambda: pg_rows(pg_url, pg_table), timeout=40, interval=0.2)
    await wait_for(lambda: queues_empty(redis_url))  # the job finished: nothing runs it again
    rows = await pg_rows(pg_url, pg_table)
    assert [r["key"] for r in rows] == ["resp_kill"], procs.logs()
    assert sim.request_count("/v1/responses/resp_kill") == 2


async def test_acknowledged_callback_survives_a_crash_with_embedded_redis(
    procs, tmp_path, provider_sim, signed_callback
):
    sim = provider_sim()
    sim.add_response("resp_durable", text="survived")
    config = write_config(tmp_path, sim.base_url)  # no redis_url: embedded, AOF on
    port = free_port()
    api = procs.start("api", "--config", str(config), "--port", str(port))
    await await_ready(port)
    body, headers = signed_callback("resp_durable")
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"http://127.0.0.1:{port}/webhooks/sim", content=body, headers=headers
        )
    assert r.status_code == 202
    api.send_signal(signal.SIGKILL)  # no clean shutdown at all
    api.wait(10)
    assert sim.request_count() == 0  # nothing ran yet: the job only lives in Redis
    port = free_port()
    procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    db = tmp_path / "data" / "results.db"

    async def landed():
        if not db.exists():
            return None
        with sqlite3.connect(db) as conn:
            try:
                return conn.execute("SELECT key, output_text FROM nopoll_results").fetchall()
            except sqlite3.OperationalError:
                return None

    rows = await wait_for(landed, timeout=30)
    assert rows == [("resp_durable", "survived")], procs.logs()
    # the same webhook-id is still remembered after the restart
    async with httpx.AsyncClient() as client:
        again = await client.post(
            f"http://127.0.0.1:{port}/webhooks/sim", content=body, headers=headers
        )
    assert again.status_code == 200


def test_sigterm_shuts_down_cleanly(procs, tmp_path, provider_sim):
    sim = provider_sim()
    config = write_config(tmp_path, sim.base_url)
    port = free_port()
    serve = procs.start("serve", "--config", str(config), "--port", str(port))
    wait_ready(port)
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(30) == 0, procs.logs()
    # the embedded Redis went with it: nothing is left listening on its socket
    sock = tmp_path / "data" / "redis" / "redis.sock"
    deadline = time.monotonic() + 10
    while sock.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sock.exists()


def test_bad_config_exits_non_zero_with_the_key(procs, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "providers:\n  x:\n    dialect: nope\n    base_url: http://a\n    webhook_secrets: [abc]\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "receiver", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "providers.x.dialect" in result.stderr


def test_demo_lands_every_result(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "receiver", "demo", "--n", "40", "--data-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "40/40" in result.stdout
    assert "1.00 per result" in result.stdout
    assert "every result landed exactly once" in result.stdout


async def test_worker_health_port_reports_its_own_poll_loop(
    procs, tmp_path, provider_sim, redis_url
):
    sim = provider_sim()
    config = write_config(tmp_path, sim.base_url, redis_url=redis_url)
    port = free_port()
    worker = procs.start("worker", "--config", str(config), "--health-port", str(port))
    async with httpx.AsyncClient(timeout=2) as client:

        async def healthy():
            try:
                r = await client.get(f"http://127.0.0.1:{port}/healthz")
            except httpx.HTTPError:
                return None
            return r if r.status_code == 200 else None

        r = await wait_for(healthy, timeout=30)
        ages = r.json()["poll_loop_age_s"]
        assert set(ages) == {"nopoll:jobs", "nopoll:batches"} and all(a < 5 for a in ages.values())
        metrics = await client.get(f"http://127.0.0.1:{port}/metrics")
        assert metrics.status_code == 200 and "nopoll_sink_rows" in metrics.text
    assert worker.poll() is None


async def test_api_answers_503_beyond_its_concurrency_limit(procs, tmp_path, provider_sim):
    sim = provider_sim()
    config = write_config(
        tmp_path, sim.base_url, extra="api: {limit_concurrency: 3, body_timeout_s: 30}\n"
    )
    port = free_port()
    procs.start("api", "--config", str(config), "--port", str(port))
    await await_ready(port)
    stalled = []
    try:
        for _ in range(3):  # three senders that never finish their bodies
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /webhooks/sim HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{")
            await writer.drain()
            stalled.append(writer)
        async with httpx.AsyncClient(timeout=5) as client:

            async def refused() -> httpx.Response | None:  # once the three are taken in
                r = await client.post(f"http://127.0.0.1:{port}/webhooks/sim", content=b"{}")
                return r if r.status_code == 503 else None

            r = await wait_for(refused, timeout=5)
        assert r.status_code == 503  # the provider retries later; nothing piles up
    finally:
        for writer in stalled:
            writer.close()
    async with httpx.AsyncClient(timeout=5) as client:
        r = await client.get(f"http://127.0.0.1:{port}/healthz")
    assert r.status_code == 200
