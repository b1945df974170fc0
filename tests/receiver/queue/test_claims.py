"""The claim rules of the arq seam's SeamWorker, against a real Redis: only a due job is
claimed, a job in progress is claimed by one worker only, the in-progress key holds the
claim's token, a Lease renews (or releases) the lock only while it holds that token, and a
stopping worker hands back the claims it has not started."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from arq.connections import ArqRedis

from receiver.queue._arq import (
    IN_PROGRESS_KEY,
    Lease,
    SeamWorker,
    arq_pool,
    func,
    job_deserializer,
    job_serializer,
)
from receiver.redis import RedisConnector

QUEUE = "nopoll:test-claims"
CLAIM_TTL_S = 30.0

MakeWorker = Callable[[], SeamWorker]


class _Worker(SeamWorker):
    async def give_up(self, *args: Any) -> None:
        raise AssertionError(f"nothing should be given up: {args}")


@pytest.fixture
async def pool(redis_url: str) -> AsyncIterator[ArqRedis]:
    client = arq_pool(RedisConnector.from_url(redis_url), queue=QUEUE)
    yield client
    await client.aclose()


@pytest.fixture
async def make_worker(redis_url: str) -> AsyncIterator[MakeWorker]:
    """Factory: a SeamWorker on QUEUE whose one job, ``hold``, runs until the test ends (so
    a claimed job stays in progress); its poll loop is never started: the tests claim."""
    release = asyncio.Event()

    async def hold(ctx: dict[str, Any]) -> None:
        await release.wait()

    made: list[SeamWorker] = []

    def make() -> SeamWorker:
        worker = _Worker(
            [func(hold, name="hold")],
            redis_pool=arq_pool(RedisConnector.from_url(redis_url), queue=QUEUE),
            queue_name=QUEUE,
            claim_ttl_s=CLAIM_TTL_S,
            handle_signals=False,
            job_serializer=job_serializer,
            job_deserializer=job_deserializer,
            keep_result=0,
        )
        made.append(worker)
        return worker

    yield make
    release.set()
    for worker in made:
        await asyncio.wait_for(asyncio.gather(*worker.tasks.values()), 10)
        await worker.close()


async def _poll(*workers: SeamWorker) -> None:
    """One turn of each worker's poll loop, all at the same moment: read the due jobs and
    claim what it can."""
    await asyncio.gather(*(w._poll_iteration() for w in workers))


async def test_a_job_that_is_not_due_yet_is_not_claimed(pool: ArqRedis, make_worker) -> None:
    await pool.enqueue_job("hold", _job_id="later", _defer_by=60)
    await pool.enqueue_job("hold", _job_id="now")
    worker = make_worker()
    await _poll(worker)
    assert set(worker.leases) == {"now"}
    assert not await pool.exists(IN_PROGRESS_KEY + "later")
    assert await pool.exists(IN_PROGRESS_KEY + "now")
    await _poll(worker)  # still not due
    assert set(worker.leases) == {"now"}


async def test_a_job_in_progress_is_claimed_by_one_worker_only(pool: ArqRedis, make_worker) -> None:
    ids = [f"job_{i}" for i in range(8)]
    for job_id in ids:
        await pool.enqueue_job("hold", _job_id=job_id)
    first, second = make_worker(), make_worker()
    await _poll(first, second)  # both see every job due at the same moment
    assert set(first.leases) | set(second.leases) == set(ids)
    assert not set(first.leases) & set(second.leases)
    held = {w: set(w.leases) for w in (first, second)}
    await _poll(first, second)  # later turns claim nothing more: every job is in progress
    await _poll(second, first)
    assert {w: set(w.leases) for w in (first, second)} == held


async def test_the_claim_token_is_written_into_the_in_progress_key(
    pool: ArqRedis, make_worker
) -> None:
    await pool.enqueue_job("hold", _job_id="j1")
    first, second = make_worker(), make_worker()
    await _poll(first)
    await pool.enqueue_job("hold", _job_id="j2")
    await _poll(second)
    assert set(first.leases) == {"j1"} and set(second.leases) == {"j2"}
    for worker, job_id in ((first, "j1"), (second, "j2")):
        lease = worker.leases[job_id]
        assert lease.key == IN_PROGRESS_KEY + job_id
        assert await pool.get(lease.key) == lease.token.encode()
        assert 0 < await pool.pttl(lease.key) <= CLAIM_TTL_S * 1000
    assert first.leases["j1"].token != second.leases["j2"].token  # each names its claim


async def test_a_lease_renews_and_releases_only_its_own_token(pool: ArqRedis) -> None:
    key = IN_PROGRESS_KEY + "leased"
    await pool.set(key, "token-a", px=1000)
    mine, other = Lease(pool, "leased", "token-a"), Lease(pool, "leased", "token-b")

    assert await mine.renew(60_000)
    assert 59_000 < await pool.pttl(key) <= 60_000
    assert not await other.renew(120_000)  # not its lock: nothing changes
    assert await pool.get(key) == b"token-a" and await pool.pttl(key) <= 60_000
    assert not await other.release()
    assert await pool.get(key) == b"token-a"

    await pool.set(key, "token-b", px=5000)  # taken over by another claim
    assert not await mine.renew(60_000)
    assert await pool.pttl(key) <= 5000
    assert not await mine.release() and await pool.get(key) == b"token-b"
    assert await other.release()
    assert not await pool.exists(key)
    assert not await mine.renew(60_000)  # a lock that is gone is not brought back
    assert not await pool.exists(key)


async def test_a_stopping_worker_hands_back_the_jobs_it_claimed_but_has_not_started(
    pool: ArqRedis, make_worker
) -> None:
    """SIGTERM (issue 20, item 2): a job claimed but not started yet is released at once,
    for another worker to claim now, not after its lock expires; a running one is kept."""
    await pool.enqueue_job("hold", _job_id="running")
    first, second = make_worker(), make_worker()
    await _poll(first)
    held = 0  # no slot left: the next job first claims stays claimed, not started
    while not first.sem.locked():
        await first.sem.acquire()
        held += 1
    await pool.enqueue_job("hold", _job_id="waiting")
    turn = asyncio.create_task(first._poll_iteration())
    try:
        for _ in range(100):
            if "waiting" in first.leases:
                break
            await asyncio.sleep(0.01)
        token = first.leases["waiting"].token.encode()
        assert await pool.get(IN_PROGRESS_KEY + "waiting") == token

        assert await first.hand_back() == 1
        assert not await pool.exists(IN_PROGRESS_KEY + "waiting")
        assert set(first.leases) == {"running"} and await pool.exists(IN_PROGRESS_KEY + "running")
        await _poll(second)  # another worker claims it at once
        assert set(second.leases) == {"waiting"}
    finally:
        for _ in range(held):
            first.sem.release()
        await asyncio.wait_for(turn, 10)
    assert set(first.tasks) == {"running"}  # the claim that was handed back never ran here
