"""Redis outages under running nopoll processes: killed, restarted and frozen for real.

Each test runs its own valkey-server with the append-only file on (as production Redis
should be), so a restart brings back exactly what was acknowledged.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
import redis as redis_sync

from receiver.queue.enqueue import HEALTH_CHECK_KEY
from tests.e2e.helpers import await_ready, pg_rows, requested, wait_for, write_config
from tests.servers import ValkeyProcess, free_port, running_api

pytestmark = pytest.mark.slow


@pytest.fixture
def own_redis() -> Iterator[ValkeyProcess]:
    server = ValkeyProcess(appendonly=True).start()
    yield server
    server.stop()


def _pg_sink(pg_url: str, pg_table: str) -> str:
    return f"  db: {{type: sql, url: '{pg_url}', table: {pg_table}}}\n"


async def _serve(procs, tmp_path, sim, own_redis, pg_url: str, pg_table: str):
    """`nopoll serve` on ``own_redis`` with a Postgres sink, once ready: (process, port)."""
    config = write_config(
        tmp_path, sim.base_url, redis_url=own_redis.url, sinks=_pg_sink(pg_url, pg_table)
    )
    port = free_port()
    serve = procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    return serve, port


async def _keys(pg_url: str, pg_table: str) -> list[str]:
    return sorted(r["key"] for r in await pg_rows(pg_url, pg_table))


async def test_worker_rides_out_a_redis_restart_and_finishes_the_job_it_was_running(
    procs, tmp_path, provider_sim, own_redis, pg_url, pg_table, signed_callback, make_settings
):
    sim = provider_sim()
    sim.add_response("resp_inflight", delay_s=1.5)  # still fetching when Redis dies
    sim.add_response("resp_after")
    config = write_config(
        tmp_path, sim.base_url, redis_url=own_redis.url, sinks=_pg_sink(pg_url, pg_table)
    )
    worker = procs.start("worker", "--config", str(config))
    direct = redis_sync.Redis.from_url(own_redis.url)

    async def polling() -> bool:
        return bool(direct.exists(HEALTH_CHECK_KEY))

    await wait_for(polling, timeout=30)
    settings = make_settings(sim.base_url, redis_url=own_redis.url)
    async with running_api(settings, own_redis.url) as (base, _), httpx.AsyncClient() as client:
        body, headers = signed_callback("resp_inflight")
        r = await client.post(f"{base}/webhooks/sim", content=body, headers=headers)
        assert r.status_code == 202

        await wait_for(requested(sim, "/v1/responses/resp_inflight"), timeout=20)
        own_redis.stop()  # SIGKILL, mid-job
        await asyncio.sleep(4)
        assert worker.poll() is None, "the worker exited when Redis went away\n" + procs.logs()
        own_redis.start()  # the same data: the queued job and its lock come back
        body, headers = signed_callback("resp_after")
        r = await client.post(f"{base}/webhooks/sim", content=body, headers=headers)
        assert r.status_code == 202

    async def both_landed() -> list[str] | None:
        keys = await _keys(pg_url, pg_table)
        return keys if keys == ["resp_after", "resp_inflight"] else None

    await wait_for(both_landed, timeout=40, interval=0.2)
    assert worker.poll() is None
    logs = procs.logs()
    # one line when Redis went away and one when it came back, not one per failed poll
    assert logs.count("worker nopoll:jobs: Redis unreachable") == 1, logs
    assert logs.count("worker nopoll:jobs: Redis is back") == 1, logs
    direct.close()


async def test_serve_answers_503_while_redis_is_down_and_the_same_delivery_succeeds_after(
    procs, tmp_path, provider_sim, own_redis, pg_url, pg_table, signed_callback
):
    sim = provider_sim()
    sim.add_response("resp_retried", text="made it")
    serve, port = await _serve(procs, tmp_path, sim, own_redis, pg_url, pg_table)
    base = f"http://127.0.0.1:{port}"
    body, headers = signed_callback("resp_retried")
    own_redis.stop()
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{base}/webhooks/sim", content=body, headers=headers)
        assert r.status_code == 503 and "retry" in r.json()["error"]
        ready = await client.get(f"{base}/readyz")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        await asyncio.sleep(3)
        assert serve.poll() is None, "nopoll serve exited when Redis went away\n" + procs.logs()
        own_redis.start()
        await await_ready(port)  # Redis and the worker's heartbeat are back
        # the provider retries the very same delivery: now it is accepted
        r = await client.post(f"{base}/webhooks/sim", content=body, headers=headers)
        assert r.status_code == 202, r.text

    async def landed() -> list[dict] | None:
        rows = await pg_rows(pg_url, pg_table)
        return rows or None

    rows = await wait_for(landed, timeout=30, interval=0.2)
    assert [(r["key"], r["output_text"]) for r in rows] == [("resp_retried", "made it")]
    assert serve.poll() is None


async def test_serve_rides_out_a_frozen_redis(
    procs, tmp_path, provider_sim, own_redis, pg_url, pg_table, signed_callback
):
    sim = provider_sim()
    sim.add_response("resp_thawed")
    serve, port = await _serve(procs, tmp_path, sim, own_redis, pg_url, pg_table)
    base = f"http://127.0.0.1:{port}"
    own_redis.freeze()  # SIGSTOP: connections stay open, nothing answers
    try:
        async with httpx.AsyncClient(timeout=15) as client:
            started = time.monotonic()
            body, headers = signed_callback("resp_frozen")
            r = await client.post(f"{base}/webhooks/sim", content=body, headers=headers)
            assert r.status_code == 503, r.text
            assert time.monotonic() - started < 10  # a bounded wait, not a hang
            await asyncio.sleep(12)  # past the worker's own Redis timeout (10 s)
            assert serve.poll() is None, "nopoll serve exited under a frozen Redis\n" + procs.logs()
    finally:
        own_redis.thaw()
    await await_ready(port)
    async with httpx.AsyncClient(timeout=10) as client:
        body, headers = signed_callback("resp_thawed")
        r = await client.post(f"{base}/webhooks/sim", content=body, headers=headers)
        assert r.status_code == 202, r.text

    async def landed() -> list[str] | None:
        keys = await _keys(pg_url, pg_table)
        return keys or None

    assert await wait_for(landed, timeout=40, interval=0.2) == ["resp_thawed"]
    assert serve.poll() is None


async def test_worker_refuses_a_redis_that_may_evict_jobs(procs, tmp_path, provider_sim):
    evicting = ValkeyProcess(extra=("--maxmemory-policy", "allkeys-lru")).start()
    try:
        sim = provider_sim()
        config = write_config(tmp_path, sim.base_url, redis_url=evicting.url)
        worker = procs.start("worker", "--config", str(config))
        try:
            code = await asyncio.to_thread(worker.wait, 60)
        except subprocess.TimeoutExpired:  # say where it stood (twice in CI, never alone)
            pytest.fail("the worker did not exit within 60 s; its log:\n" + procs.logs())
        logs = procs.logs()
        assert code == 2, logs
        assert "maxmemory-policy is 'allkeys-lru'" in logs and "noeviction" in logs

        # redis_policy_check: warn starts anyway, saying why it should not
        config.write_text(config.read_text() + "redis_policy_check: warn\n")
        warned = procs.start("worker", "--config", str(config))
        direct = redis_sync.Redis.from_url(evicting.url)

        async def warned_and_polling() -> bool:
            warnings = procs.logs().count("maxmemory-policy is 'allkeys-lru'")
            return warnings >= 2 and bool(direct.exists(HEALTH_CHECK_KEY))

        try:
            await wait_for(warned_and_polling, timeout=30)
        finally:
            direct.close()
        assert warned.poll() is None, procs.logs()
    finally:
        evicting.stop()
