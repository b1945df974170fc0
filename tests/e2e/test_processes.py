"""nopoll as users run it: separate processes, killed and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_pipeline import pg_rows, wait_for
from tests.servers import free_port, running_api

pytestmark = pytest.mark.slow


class Processes:
    """Starts nopoll commands; stops each one by its PID at the end of the test."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env, self.started = tmp, env, []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        with (self.tmp / f"nopoll-{len(self.started)}.log").open("wb") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", "receiver", *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.started.append(p)
        return p

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace") for p in sorted(self.tmp.glob("nopoll-*.log"))
        )

    def stop_all(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture
def procs(tmp_path: Path, webhook_secret: str) -> Iterator[Processes]:
    env = {**os.environ, "SIM_SECRET": webhook_secret}
    p = Processes(tmp_path, env)
    yield p
    p.stop_all()


def write_config(
    tmp: Path, base_url: str, *, redis_url: str = "", sinks: str = "", extra: str = ""
) -> Path:
    path = tmp / "nopoll.yaml"
    path.write_text(
        f"redis_url: '{redis_url}'\n"
        f"data_dir: {tmp / 'data'}\n"
        "providers:\n"
        "  sim:\n"
        "    dialect: openai\n"
        f"    base_url: {base_url}\n"
        "    webhook_secrets: ['${SIM_SECRET}']\n"
        + (f"sinks:\n{sinks}" if sinks else "")
        + "fetch_retry: {max_tries: 5, base_delay_s: 0.1, max_delay_s: 0.5}\n"
        "worker: {poll_delay_s: 0.01, response_job_timeout_s: 2, health_check_interval_s: 1}\n"
        + extra
    )
    return path


def wait_ready(port: int, limit_s: float = 30) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("nopoll did not become ready")


async def await_ready(port: int) -> None:
    await asyncio.to_thread(wait_ready, port)


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

    async def fetching() -> bool:
        return sim.request_count("/v1/responses/resp_kill") >= 1

    await wait_for(fetching, timeout=20)
    worker.send_signal(signal.SIGKILL)  # mid-job: the provider has not answered yet
    worker.wait(10)
    slow.delay_s = 0
    procs.start("worker", "--config", str(config))
    # arq re-runs it once the dead worker's in-progress lock (job timeout + 10 s) expires
    rows = await wait_for(lambda: pg_rows(pg_url, pg_table), timeout=40, interval=0.2)
    await asyncio.sleep(1.0)
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
