"""What a new user sees in the first hour: start-up summary, rejected callbacks in the
log (rate-limited), a line per landed result, sink health in /readyz, and providers that
take no callbacks. Every test runs the installed ``nopoll`` command."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import httpx
import pytest

from tests.e2e.helpers import NOPOLL, await_ready, wait_for, wait_ready, write_config
from tests.servers import free_port

pytestmark = pytest.mark.slow


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


async def test_logs_tell_a_new_user_what_runs_what_was_refused_and_what_landed(
    procs, tmp_path, provider_sim, redis_url, signed_callback, webhook_secret
):
    sim = provider_sim()
    sim.add_response("resp_logged")
    config = write_config(tmp_path, sim.base_url, redis_url=redis_url)
    port = free_port()
    procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    url = f"http://127.0.0.1:{port}/webhooks/sim"
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(40):  # a flood of forged callbacks
            body, headers = signed_callback("resp_x", secret="whsec_" + "A" * 43)
            assert (await client.post(url, content=body, headers=headers)).status_code == 401
        body, headers = signed_callback("resp_logged")
        assert (await client.post(url, content=body, headers=headers)).status_code == 202

    async def landed_line():
        return "response sim/resp_logged landed (completed) in db, files" in procs.logs()

    await wait_for(landed_line, timeout=20)
    lines = _json_lines(procs.logs())
    messages = [entry["msg"] for entry in lines]
    # the start-up summary: what runs, which Redis, the webhook path, the sinks
    assert any(m.startswith("nopoll ") and "API on http://127.0.0.1" in m for m in messages)
    assert any(m.startswith("redis: redis://127.0.0.1") for m in messages)
    assert any("provider sim (openai): callbacks at POST /webhooks/sim" in m for m in messages)
    assert any(m.startswith("sink db: sql -> SQLite file /") for m in messages)
    # forty forged callbacks: one line with the reason, not forty
    rejected = [m for m in messages if "answered 401" in m]
    assert len(rejected) == 1 and "no matching signature" in rejected[0], rejected
    # no ANSI colour field from uvicorn, and no secret anywhere
    assert not any("color_message" in entry for entry in lines)
    raw = procs.logs()
    assert webhook_secret not in raw and webhook_secret.removeprefix("whsec_") not in raw


async def test_readyz_shows_a_sink_that_cannot_start_without_failing_readiness(
    procs, tmp_path, provider_sim, redis_url
):
    sim = provider_sim()
    dead_port = free_port()  # nothing listens there
    sinks = (
        f"  files: {{type: jsonl, dir: '{tmp_path / 'out'}'}}\n"
        f"  warehouse: {{type: sql, url: 'postgresql://nobody@127.0.0.1:{dead_port}/x'}}\n"
    )
    config = write_config(tmp_path, sim.base_url, redis_url=redis_url, sinks=sinks)
    port = free_port()
    procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    async with httpx.AsyncClient(timeout=5) as client:

        async def sinks_shown():
            r = await client.get(f"http://127.0.0.1:{port}/readyz")
            sinks = r.json().get("sinks") or {}
            return (r, sinks) if "warehouse" in sinks and "files" in sinks else None

        r, sinks = await wait_for(sinks_shown, timeout=30, interval=0.3)
    assert r.status_code == 200  # callbacks still queue safely
    assert sinks["warehouse"] == "failing"  # its error text only on api.operator_port
    assert sinks["files"] in ("ok", "not opened")
    # send-test says so right after its 202
    result = await asyncio.to_thread(
        subprocess.run,
        [
            str(NOPOLL),
            "send-test",
            "--config",
            str(config),
            "sim",
            "--url",
            f"http://127.0.0.1:{port}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=procs.env,
    )
    assert result.returncode == 0 and "202 queued" in result.stdout, result.stderr
    assert "but sink warehouse is failing: " in result.stdout


async def test_a_provider_without_webhook_secrets_answers_404_saying_why(
    procs, tmp_path, provider_sim, redis_url, signed_callback
):
    sim = provider_sim()
    config = write_config(tmp_path, sim.base_url, redis_url=redis_url)
    config.write_text(config.read_text().replace("    webhook_secrets: ['${SIM_SECRET}']\n", ""))
    port = free_port()
    procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    body, headers = signed_callback("resp_nope")
    async with httpx.AsyncClient(timeout=5) as client:
        r = await client.post(
            f"http://127.0.0.1:{port}/webhooks/sim", content=body, headers=headers
        )
    assert r.status_code == 404
    assert r.json() == {"error": "provider 'sim' takes no callbacks (it has no webhook_secrets)"}


async def test_a_fresh_start_on_sqlite_logs_no_table_error(procs, tmp_path, provider_sim):
    sim = provider_sim()
    config = write_config(tmp_path, sim.base_url)  # embedded Redis, SQLite + JSONL
    port = free_port()
    procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    await asyncio.sleep(1.0)
    logs = procs.logs()
    assert "already exists" not in logs and "not ready yet" not in logs, logs


def test_start_up_says_where_config_and_data_live_and_which_surfaces_are_on(
    tmp_path, webhook_secret
):
    """Run from the config's folder with a relative data_dir and a relative SQLite URL,
    as the README's "Try it with your own config" does: every path is shown absolute
    (``sqlite+aiosqlite:///nopoll-data/...`` reads as ``/nopoll-data``), and the log
    says which HTTP surfaces are on, which are off and why."""
    (tmp_path / "nopoll.yaml").write_text(
        "log_format: text\n"
        "data_dir: ./nopoll-data\n"
        "admin_tokens: ['${ADMIN_TOKEN}']\n"
        "sinks:\n"
        "  db: {type: sql, url: 'sqlite:///nopoll-data/results.db'}\n"
    )
    env = {**os.environ, "ADMIN_TOKEN": "admin-token-0123456789-abcdefghij"}
    log = tmp_path / "serve.log"
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(NOPOLL), "serve", "--config", "nopoll.yaml", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_ready(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    text = log.read_text()
    data = tmp_path / "nopoll-data"
    assert f"config: {tmp_path / 'nopoll.yaml'}; data_dir: {data}\n" in text, text
    assert f"sink db: sql -> SQLite file {data / 'results.db'}\n" in text, text
    assert "sqlite+aiosqlite:///nopoll-data" not in text
    base = f"http://127.0.0.1:{port}"
    assert (
        f"http: POST /webhooks/{{provider}}, /healthz, /readyz, /metrics, admin API "
        f"{base}/admin/v1 and status page {base}/ui (1 admin token(s)); "
        "off: /v1 (no consumer_tokens)\n"
    ) in text, text
    assert "admin-token-0123456789" not in text
