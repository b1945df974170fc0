"""The batch lease, pinned against real servers: one failed renewal does not let the lock
expire, a run that cannot renew stops before its lock expires, and a run whose lock was
taken over stops and leaves the job to its new owner."""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis as redis_sync

from receiver.batches.runner import LeaseLost
from receiver.queue._arq import IN_PROGRESS_KEY, JOB_KEY, Lease, arq_pool
from receiver.queue.enqueue import batch_job_id
from receiver.redis import RedisConnector
from tests.e2e.helpers import post, wait_for
from tests.e2e.losses import run_batch
from tests.servers import TcpProxy, running_api, running_worker


async def _watch_lock(redis_url: str, key: str, stop: asyncio.Event) -> list[int]:
    """PTTL of the lock every 50 ms until ``stop`` (-2: it expired)."""
    seen: list[int] = []
    client = redis_sync.Redis.from_url(redis_url)
    try:
        while not stop.is_set():
            seen.append(int(await asyncio.to_thread(client.pttl, key)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)
    finally:
        client.close()
    return seen


def _redis_port(redis_url: str) -> tuple[str, int]:
    hostport = redis_url.split("//", 1)[1].split("/", 1)[0]
    host, _, port = hostport.partition(":")
    return host, int(port or 6379)


async def _leased_run(loss_stack, redis_url, tmp_path, cut_s: float | None):
    files = {"files": {"type": "jsonl", "dir": str(tmp_path / "out")}}
    settings, sim = loss_stack("valar", sinks=files)
    # With the cut for good, the batch must outlast the lease's give-up (1.6 s here) by far:
    # a run that finishes first proves nothing (it did once, on a loaded CI machine).
    sim.add_batch("valar", "batch_lease", 3000, row_delay_s=0.05 if cut_s is not None else 0.3)
    job_id = batch_job_id("sim", "batch_lease")
    lock = IN_PROGRESS_KEY + job_id
    direct = redis_sync.Redis.from_url(redis_url)
    direct.set(lock, "token-1", px=2000)
    proxy = TcpProxy(*_redis_port(redis_url))
    await proxy.up()
    db = redis_url.rsplit("/", 1)[1]
    leased = arq_pool(RedisConnector.from_url(f"redis://127.0.0.1:{proxy.port}/{db}"))
    lease = Lease(leased, job_id, "token-1")
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_lock(redis_url, lock, stop))
    run = asyncio.create_task(run_batch(settings, redis_url, "batch_lease", lease=lease))
    try:

        async def fetching() -> bool:
            return sim.request_count("/v1/batches/batch_lease/") > 0

        await wait_for(fetching, timeout=20, interval=0.01)
        await proxy.down()
        if cut_s is not None:
            await asyncio.sleep(cut_s)
            await proxy.up()
        try:
            result = await asyncio.wait_for(run, 60)
        except LeaseLost as exc:
            result = exc
        ttl_then = direct.pttl(lock)
    finally:
        stop.set()
        ttls = await watcher
        await proxy.down()
        await leased.aclose()
        direct.close()
    return result, lease, ttl_then, ttls


async def test_one_failed_lease_renewal_does_not_let_the_lock_expire_under_a_running_batch(
    loss_stack, redis_url, tmp_path
):
    outcome, _, _, ttls = await _leased_run(loss_stack, redis_url, tmp_path, cut_s=0.7)
    assert not isinstance(outcome, LeaseLost) and outcome.rows == 3000
    assert ttls and min(ttls) > 0, "the batch's lock expired while it was still running"


async def test_a_batch_that_cannot_renew_its_lease_stops_before_the_lock_expires(
    loss_stack, redis_url, tmp_path
):
    started = time.monotonic()
    outcome, lease, ttl_then, _ = await _leased_run(loss_stack, redis_url, tmp_path, cut_s=None)
    assert isinstance(outcome, LeaseLost) and lease.lost
    assert time.monotonic() - started < 10
    assert ttl_then > 0, "the run outlived its lock: a second run could have started"


async def test_a_batch_whose_lock_was_taken_over_stops_and_leaves_the_job_to_the_new_owner(
    loss_stack, redis_url, redis_sync_client, signed_callback, caplog
):
    settings, sim = loss_stack("valar", sinks={"files": {"type": "jsonl", "dir": "/tmp/nopoll-x"}})
    sim.add_batch("valar", "batch_taken", 3000, row_delay_s=0.05)
    job_id = batch_job_id("sim", "batch_taken")
    lock = IN_PROGRESS_KEY + job_id
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        r = await post(base, *signed_callback("batch_taken", event_type="batch.completed"))
        assert r.status_code == 202

        async def running() -> bool:  # mid-stream: locked, and rows are being fetched
            rows = sim.request_count("/v1/batches/batch_taken/")
            return bool(redis_sync_client.exists(lock)) and rows > 0

        await wait_for(running, timeout=20)
        redis_sync_client.set(lock, "another-worker", px=60_000)  # another run owns it now
        fetched = sim.request_count("/v1/batches/batch_taken/")

        async def stopped() -> bool:  # lease_s 2: the holder renews every 0.67 s
            return any("this run stopped" in r.getMessage() for r in caplog.records)

        await wait_for(stopped, timeout=30)  # a loaded CI machine took over 10 s once
        stalled = sim.request_count("/v1/batches/batch_taken/")
        await asyncio.sleep(1)  # nothing fetches any more
        # this run stopped; the new owner's lock and the job are untouched
        assert sim.request_count("/v1/batches/batch_taken/") == stalled >= fetched > 0
        assert redis_sync_client.get(lock) == b"another-worker"
        assert redis_sync_client.exists(JOB_KEY + job_id)
