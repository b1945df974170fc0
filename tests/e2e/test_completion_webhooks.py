"""Sail's and Valar's completion webhooks, end to end: ``nopoll submit`` asks for them, the
simulator pushes each finished Response object with the account's bearer token, and
``nopoll serve`` lands it (one GET by id, or none when the body is trusted). Pushes the
provider never sends are landed by the watches' slow reconcile."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from receiver.providers.push import PUSH_TOKEN_KEY
from tests.e2e.helpers import (
    nopoll_submit,
    sql_sink,
    wait_pg_rows,
    wait_ready,
    write_config,
)
from tests.servers import free_port

pytestmark = pytest.mark.slow


def _lines(path, n):
    with path.open("wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"model": "m-1", "input": f"q {i}", "custom_id": f"q{i:04d}"}))
            f.write(b"\n")
    return path


def _config(tmp_path, sim, redis_url, pg_url, pg_table, port, *, reconcile_s=900, more=""):
    provider = (
        "    rate_limit_rps: null\n"  # the simulator has no request limit (valar's is 1/s)
        f"    watch: {{first_poll_s: 0.2, max_interval_s: 1, reconcile_after_s: {reconcile_s}}}\n"
        + more
    )
    return write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        sinks=sql_sink(pg_url, pg_table),
        dialect=sim.dialect,
        provider=provider,
        extra=f"public_url: http://127.0.0.1:{port}\n",
    )


@pytest.mark.parametrize("dialect", ["sail", "valar"])
async def test_submit_lands_every_result_through_completion_webhooks_with_one_get_each(
    procs, tmp_path, provider_sim, redis_url, redis_sync_client, pg_url, pg_table, dialect
):
    n = 1000 if dialect == "sail" else 200
    port = free_port()
    sim = provider_sim(dialect=dialect, complete_after_s=0.3, webhook_concurrency=32)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table, port)
    procs.start("serve", "--config", str(config), "--port", str(port))
    await asyncio.to_thread(wait_ready, port)
    source = _lines(tmp_path / "pushed.jsonl", n)

    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = await wait_pg_rows(pg_url, pg_table, n, timeout=120)
    assert len({r["key"] for r in rows}) == n
    # every one landed by its push (event_id push:<id>), none by a poll
    assert all(r["event_id"] == f"push:{r['key']}" for r in rows)
    # creates excluded: one GET by id per result, and no poll
    gets = sim.request_count("/v1/responses/")
    assert gets / n <= 1.05, gets
    pushed = [d for d in sim.creates.deliveries if d[2] is not None]
    assert len(pushed) == n and all(200 <= status < 300 for _, _, status in pushed)
    # every create asked for the push, with nopoll's endpoint and the account's token
    token = redis_sync_client.get(PUSH_TOKEN_KEY + "sim").decode()
    asked = [r.body["metadata"] for r in sim.creates.received("/v1/responses")]
    assert all(m["completion_webhook"] == f"http://127.0.0.1:{port}/webhooks/sim" for m in asked)
    assert all(m["webhook_token"] == token for m in asked)
    # the token never reaches a sink (the provider echoes the metadata) nor a log
    for row in rows:
        assert token not in orjson.dumps(row).decode()
        metadata = orjson.loads(row["metadata"])
        assert metadata["webhook_token"] == "[redacted]"
    assert token not in procs.logs() and token not in done.stdout + done.stderr


async def test_pushes_the_provider_drops_land_by_the_reconcile_poll(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    port = free_port()
    sim = provider_sim(dialect="sail", complete_after_s=0.3, push_drop=0.1)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table, port, reconcile_s=3)
    procs.start("serve", "--config", str(config), "--port", str(port))
    await asyncio.to_thread(wait_ready, port)
    source = _lines(tmp_path / "lossy.jsonl", 300)

    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = await wait_pg_rows(pg_url, pg_table, 300, timeout=90)
    assert len({r["key"] for r in rows}) == 300
    polled = [r for r in rows if r["event_id"] is None]
    pushed = [r for r in rows if r["event_id"] is not None]
    sent = {rid for rid, _, status in sim.creates.deliveries if status is not None}
    assert {r["key"] for r in pushed} == sent
    assert 10 <= len(polled) == 300 - len(sent) <= 60  # about a tenth was never pushed


async def test_a_trusted_push_lands_as_it_came_without_a_get(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    port = free_port()
    sim = provider_sim(dialect="valar", complete_after_s=0.2)
    more = "    completion_webhook: {trust_body: true}\n"
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table, port, more=more)
    procs.start("serve", "--config", str(config), "--port", str(port))
    await asyncio.to_thread(wait_ready, port)
    source = _lines(tmp_path / "trusted.jsonl", 100)

    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = await wait_pg_rows(pg_url, pg_table, 100, timeout=60)
    assert len(rows) == 100 and all(r["status"] == "completed" for r in rows)
    assert all(r["output_text"] for r in rows)
    assert sim.request_count("/v1/responses/") == 0
