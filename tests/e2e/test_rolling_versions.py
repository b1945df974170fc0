"""A rolling upgrade: a worker of this version that takes a job a newer nopoll queued (a
payload version it cannot read) hands it to a live worker that reads it, logs it and
counts it, instead of making it a dead letter. The newer nopoll is this tree with its
payload and batch-progress versions raised, run from a copy as real processes."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
from redis.asyncio import Redis

from receiver.queue.deadletter import DeadLetters
from receiver.worker.liveness import SERVED_KEY
from tests.e2e.helpers import await_ready, pg_rows, wait_for
from tests.newer import newer_tree
from tests.servers import free_port

pytestmark = pytest.mark.slow

ROWS = 300
HANDED_BACK = r'nopoll_jobs_total\{function="(\w+)",outcome="handed_back"\} (\S+)'


def _config(
    tmp: Path, base_url: str, redis_url: str, pg_url: str, table: str, extra: str = ""
) -> Path:
    """Both nopolls' config: provider ``sim``, a Postgres sink, fast polls and heartbeats."""
    config = tmp / "nopoll.yaml"
    config.write_text(
        f"redis_url: '{redis_url}'\ndata_dir: {tmp / 'data'}\n"
        f"providers:\n  sim:\n    dialect: openai\n    base_url: {base_url}\n"
        "    webhook_secrets: ['${SIM_SECRET}']\n    rate_limit_rps: null\n"
        f"sinks:\n  db: {{type: sql, url: '{pg_url}', table: {table}}}\n"
        "worker: {poll_delay_s: 0.01, health_check_interval_s: 1}\n" + extra
    )
    return config


async def test_a_worker_hands_a_newer_nopolls_batch_to_a_worker_that_reads_it(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, signed_callback
):
    sim = provider_sim()
    batch = sim.add_batch("openai", "batch_newer", ROWS)
    responses = [f"resp_newer_{i}" for i in range(20)]
    for rid in responses:
        sim.add_response(rid)
    config = _config(tmp_path, sim.base_url, redis_url, pg_url, pg_table)
    api_port, health_port = free_port(), free_port()
    ours = dict(procs.env)
    procs.env = {**ours, "PYTHONPATH": str(newer_tree(tmp_path))}
    procs.start("api", "--config", str(config), "--port", str(api_port))
    newer_worker = procs.start("worker", "--config", str(config))
    procs.env = ours
    procs.start("worker", "--config", str(config), "--health-port", str(health_port))
    await await_ready(api_port)
    client = redis_sync.Redis.from_url(redis_url)

    async def both_published() -> bool:
        reads = [e.decode() for e in client.hvals(SERVED_KEY)]
        return len(reads) == 2 and sum('"job:3"' in e for e in reads) == 1

    await wait_for(both_published, timeout=60, interval=0.2)
    newer_worker.send_signal(signal.SIGSTOP)  # only the older worker takes jobs for now
    async with httpx.AsyncClient(timeout=10) as http:
        url = f"http://127.0.0.1:{api_port}/webhooks/sim"

        async def send(object_id: str, event: str) -> None:
            body, headers = signed_callback(object_id, event_type=event)
            answer = await http.post(url, content=body, headers=headers)
            assert answer.status_code == 202, answer.text

        try:
            await send("batch_newer", "batch.completed")  # begun by the newer nopoll's API

            async def handed_back() -> bool:
                return "fetch_batch payload version 3" in procs.logs()

            await wait_for(handed_back, timeout=6, interval=0.05)
        finally:
            newer_worker.send_signal(signal.SIGCONT)
        for rid in responses:  # and then the newer API's responses, with both workers up
            await send(rid, "response.completed")

    rows = {f"batch_newer/{batch.custom_id(i) or f'~{i}'}" for i in range(ROWS)}
    keys = rows | {"batch_newer"} | set(responses)

    async def landed() -> bool:
        return keys <= {r["key"] for r in await pg_rows(pg_url, pg_table)}

    await wait_for(landed, timeout=90, interval=0.5)
    async with httpx.AsyncClient(timeout=10) as http:
        metrics = (await http.get(f"http://127.0.0.1:{health_port}/metrics")).text
    handed = re.findall(HANDED_BACK, metrics)
    assert dict(handed).get("fetch_batch") not in (None, "0.0"), metrics[-2000:]
    client.close()
    letters = Redis.from_url(redis_url)
    try:
        assert await DeadLetters(letters).count() == 0, procs.logs()[-3000:]
    finally:
        await letters.aclose()


async def test_a_batch_queued_by_a_newer_api_waits_for_a_newer_worker(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, signed_callback
):
    """The API rolled before the workers: a newer API queues a batch while only workers of
    this version run. They retry it (with its backoff, counted as tries) instead of making
    it a dead letter at once; the newer worker, started later, runs it."""
    sim = provider_sim()
    batch = sim.add_batch("openai", "batch_api_first", ROWS)
    config = _config(
        tmp_path, sim.base_url, redis_url, pg_url, pg_table,
        "fetch_retry: {max_tries: 8, base_delay_s: 0.5, max_delay_s: 4}\n",
    )  # fmt: skip
    api_port, health_port = free_port(), free_port()
    ours = dict(procs.env)
    newer = {**ours, "PYTHONPATH": str(newer_tree(tmp_path))}
    procs.env = newer
    procs.start("api", "--config", str(config), "--port", str(api_port))
    procs.env = ours
    procs.start("worker", "--config", str(config), "--health-port", str(health_port))
    await await_ready(api_port)
    async with httpx.AsyncClient(timeout=10) as http:
        body, headers = signed_callback("batch_api_first", event_type="batch.completed")
        answer = await http.post(
            f"http://127.0.0.1:{api_port}/webhooks/sim", content=body, headers=headers
        )
        assert answer.status_code == 202, answer.text

        async def taken() -> bool:  # and refused by version
            return "payload version 3" in procs.logs()

        await wait_for(taken, timeout=15, interval=0.05)
        letters = Redis.from_url(redis_url)
        try:
            assert await DeadLetters(letters).count() == 0, procs.logs()[-3000:]
            assert "no live worker reads it yet: retrying" in procs.logs()
            procs.env = newer  # the worker Deployment rolls: a newer worker joins
            procs.start("worker", "--config", str(config))
            procs.env = ours
            keys = {f"batch_api_first/{batch.custom_id(i) or f'~{i}'}" for i in range(ROWS)}

            async def landed() -> bool:
                return keys <= {r["key"] for r in await pg_rows(pg_url, pg_table)}

            await wait_for(landed, timeout=90, interval=0.5)
            assert await DeadLetters(letters).count() == 0, procs.logs()[-3000:]
        finally:
            await letters.aclose()
        metrics = (await http.get(f"http://127.0.0.1:{health_port}/metrics")).text
    assert 'function="fetch_batch",outcome="retry"' in metrics, metrics[-2000:]
