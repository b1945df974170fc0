"""What the loss-path tests share (test_nothing_lost.py, test_batch_leases.py): small
batches with a short lease, nopoll serving, and reading dead letters and batch progress."""

from __future__ import annotations

import contextlib

from nopoll.envelope import now_rfc3339
from receiver.batches.progress import batch_state_key
from receiver.metrics import Metrics
from receiver.queue._arq import arq_pool
from receiver.queue.deadletter import DeadLetters
from receiver.redis import RedisConnector
from receiver.worker.state import build_state
from tests.e2e.helpers import pg_rows, post, wait_for
from tests.servers import running_api, running_worker

BATCH = {"chunk_size": 200, "lease_s": 2, "sink_attempts": 2, "max_jobs": 2}


@contextlib.asynccontextmanager
async def serving(settings, redis_url: str, callback: tuple[bytes, dict]):
    """nopoll's API and worker running, and ``callback`` accepted (202) by the API."""
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        r = await post(base, *callback)
        assert r.status_code == 202
        yield


async def letters(redis_url: str, **selector) -> list:
    pool = arq_pool(RedisConnector.from_url(redis_url))
    try:
        return await DeadLetters(pool).find(**selector)
    finally:
        await pool.aclose()


async def batch_done(redis_url: str, batch_id: str) -> bool:
    """True once the batch job ran to its end (every summary written or parked)."""
    pool = arq_pool(RedisConnector.from_url(redis_url))
    try:
        return await pool.hget(batch_state_key("sim", batch_id), "done") == b"1"
    finally:
        await pool.aclose()


async def replay_all(redis_url: str) -> int:
    pool = arq_pool(RedisConnector.from_url(redis_url))
    try:
        store = DeadLetters(pool)
        return await store.replay(await store.find())
    finally:
        await pool.aclose()


async def summary_rows(pg_url: str, pg_table: str, batch_id: str) -> list[dict]:
    async def done() -> list[dict] | None:
        rows = await pg_rows(pg_url, pg_table)
        return rows if any(r["kind"] == "batch" and r["key"] == batch_id for r in rows) else None

    return await wait_for(done, timeout=60, interval=0.2)


async def run_batch(settings, redis_url: str, batch_id: str, **kwargs):
    state = build_state(
        settings, RedisConnector.from_url(redis_url), Metrics()
    )  # what nopoll fetch-batch uses
    try:
        return await state.batch_runner.run(
            state.dialects["sim"],
            provider="sim",
            batch_id=batch_id,
            event_id=None,
            received_at=now_rfc3339(),
            **kwargs,
        )
    finally:
        await state.aclose()
