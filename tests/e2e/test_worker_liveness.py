"""Work held by a worker process that dies, or stops on SIGTERM, goes to the other worker
within its heartbeat bound (or at once), and lands once: real `nopoll worker` processes,
the provider simulator hanging the dead worker's requests, Postgres rows counted."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
from redis.asyncio import Redis

from receiver.queue._arq import IN_PROGRESS_KEY
from receiver.queue.enqueue import batch_job_id
from receiver.watches.store import WatchStore
from tests.e2e.helpers import pg_rows, post, wait_for
from tests.servers import running_api

pytestmark = pytest.mark.slow

HANG_S = 28.0
"""How long the simulator holds the first GET of each id (below the 30 s read timeout)."""
N = 8


def _config(tmp_path: Path, base_url: str, redis_url: str, pg_url: str, table: str) -> Path:
    """Two providers on one simulator: ``sim`` (responses, watches) and ``simv`` (valar
    batches); jobs with a long deadline, so only the liveness bound can free them early."""
    path = tmp_path / "nopoll.yaml"
    provider = (
        f"    base_url: {base_url}\n    webhook_secrets: ['${{SIM_SECRET}}']\n"
        "    watch: {first_poll_s: 0.3, max_interval_s: 1}\n"
    )
    slow = "    max_concurrency: 2\n"  # the batch streams 40 rows/s: it is mid-stream for a while
    path.write_text(
        f"redis_url: '{redis_url}'\n"
        f"data_dir: {tmp_path / 'data'}\n"
        "providers:\n"
        f"  sim:\n    dialect: openai\n{provider}"
        f"  simv:\n    dialect: valar\n{provider}{slow}"
        f"sinks:\n  db: {{type: sql, url: '{pg_url}', table: {table}}}\n"
        "fetch_retry: {max_tries: 5, base_delay_s: 0.1, max_delay_s: 0.5}\n"
        "worker: {poll_delay_s: 0.01, response_job_timeout_s: 60, health_check_interval_s: 1,"
        " shutdown_wait_s: 20}\n"
        "batch: {chunk_size: 50}\n"
    )
    return path


async def _started(procs, index: int) -> None:
    """Worker process ``index`` (its log ``nopoll-<index>.log``) runs its poll loops."""

    async def running() -> bool:
        log = procs.tmp / f"nopoll-{index}.log"
        return log.exists() and log.read_text(errors="replace").count("worker for ") >= 2

    await wait_for(running, timeout=60, interval=0.2)


async def _worker_holding_everything(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, make_settings, signed_callback
):
    """Worker A holds N watches mid-poll, N response jobs mid-fetch and a batch mid-stream
    (every first GET hangs ``HANG_S``); then worker B starts. (A, sim, batch, config)."""
    sim = provider_sim()
    for i in range(N):
        sim.add_response(f"resp_watch_{i}", delay_s=HANG_S, delay_times=1)
        sim.add_response(f"resp_job_{i}", delay_s=HANG_S, delay_times=1)
    batch = sim.add_batch("valar", "batch_live", 800, row_delay_s=0.05)
    config = _config(tmp_path, sim.base_url, redis_url, pg_url, pg_table)
    worker_a = procs.start("worker", "--config", str(config))
    await _started(procs, 0)
    settings = make_settings(sim.base_url, redis_url=redis_url)
    valar = settings.providers["sim"].model_copy(update={"dialect": "valar"})
    settings = settings.model_copy(update={"providers": {**settings.providers, "simv": valar}})
    async with running_api(settings, redis_url) as (base, _):
        for i in range(N):
            assert (await post(base, *signed_callback(f"resp_job_{i}"))).status_code == 202
        body, headers = signed_callback("batch_live", event_type="batch.completed")
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{base}/webhooks/simv", content=body, headers=headers)
        assert r.status_code == 202
    client = redis_sync.Redis.from_url(redis_url)
    store = WatchStore(Redis.from_url(redis_url))
    try:
        ids = [f"resp_watch_{i}" for i in range(N)]
        assert all(await store.register_all("sim", "response", ids, first_poll_in_s=0))
    finally:
        await store.redis.aclose()

    async def all_held() -> bool:
        hanging = all(sim.request_count(f"/v1/responses/{rid}") for rid in _responses())
        return hanging and client.hget("nopoll:batch:simv:batch_live", "c:db") is not None

    await wait_for(all_held, timeout=60, interval=0.1)
    procs.start("worker", "--config", str(config))  # worker B
    await _started(procs, 1)
    lock = client.get(IN_PROGRESS_KEY + batch_job_id("simv", "batch_live"))
    client.close()
    assert lock is not None, "the batch is no longer streaming: make it slower"
    return worker_a, sim, batch, lock


async def _landed(pg_url: str, table: str, keys: set[str]) -> list[dict] | None:
    rows = await pg_rows(pg_url, table)
    return rows if keys <= {r["key"] for r in rows} else None


async def _all_landed(pg_url: str, table: str, keys: set[str], limit_s: float) -> list[dict]:
    """The rows once every key landed; else fail saying which ones are missing."""
    try:
        return await wait_for(lambda: _landed(pg_url, table, keys), timeout=limit_s, interval=0.5)
    except AssertionError:
        found = {r["key"] for r in await pg_rows(pg_url, table)}
        missing = sorted(keys - found)
        pytest.fail(f"{len(missing)} of {len(keys)} not landed in {limit_s:g} s: {missing[:12]}")


def _responses(kinds: tuple[str, ...] = ("watch", "job")) -> set[str]:
    return {f"resp_{kind}_{i}" for kind in kinds for i in range(N)}


def _expected(batch) -> set[str]:
    """Every row's key, and the summary's (the batch id)."""
    rows = {f"{batch.batch_id}/{batch.custom_id(i) or f'~{i}'}" for i in range(batch.n_rows)}
    return rows | {batch.batch_id}


async def test_a_sigkilled_workers_watches_jobs_and_batch_resume_within_the_heartbeat_bound(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, make_settings, signed_callback
):
    worker_a, sim, batch, _ = await _worker_holding_everything(
        procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, make_settings, signed_callback
    )
    responses = _responses()
    rows_before = sum(batch.served.values())
    worker_a.send_signal(signal.SIGKILL)  # polls, fetches and the batch stream all in flight
    worker_a.wait(10)
    killed = time.monotonic()
    keys = responses | _expected(batch)
    # the liveness bound is 30 s after the last heartbeat; 45 s leaves room for the
    # batch's remaining rows (today: 65 s for the jobs' locks, 315 s for the watches)
    rows = await _all_landed(pg_url, pg_table, keys, 45)
    took = time.monotonic() - killed
    assert took < 45, procs.logs()
    counts = Counter(r["key"] for r in rows)
    assert set(counts) == keys and set(counts.values()) == {1}
    for rid in responses:  # the dead worker's hanging GET, and the one that landed it
        assert sim.request_count(f"/v1/responses/{rid}") == 2, rid
    # the batch resumed after its committed chunks, not from its first row
    assert sum(batch.served.values()) - batch.n_rows < rows_before


async def test_a_sigtermed_worker_hands_its_watches_and_batch_to_the_other_at_once(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, make_settings, signed_callback
):
    worker_a, sim, batch, held_by_a = await _worker_holding_everything(
        procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, make_settings, signed_callback
    )
    client = redis_sync.Redis.from_url(redis_url)
    lock = IN_PROGRESS_KEY + batch_job_id("simv", "batch_live")
    watches = _responses(("watch",))
    stopped = time.monotonic()
    worker_a.send_signal(signal.SIGTERM)

    async def taken_over() -> bool:
        owner = client.get(lock)
        return owner is not None and owner != held_by_a

    async def watches_landed() -> bool:
        return bool(await _landed(pg_url, pg_table, watches))

    try:
        await wait_for(taken_over, timeout=10, interval=0.05)
        await wait_for(watches_landed, timeout=10 - (time.monotonic() - stopped), interval=0.2)
        assert time.monotonic() - stopped < 10
        keys = _expected(batch) | _responses()
        rows = await _all_landed(pg_url, pg_table, keys, 90)
    finally:
        client.close()
    counts = Counter(r["key"] for r in rows)
    assert set(counts.values()) == {1}
    for rid in watches:
        assert sim.request_count(f"/v1/responses/{rid}") == 2, rid
    try:
        assert await asyncio.to_thread(worker_a.wait, 60) == 0, procs.logs()
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker A did not exit after SIGTERM:\n{procs.logs()}")
