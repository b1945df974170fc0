"""The arq seam's own way of running jobs (receiver.queue._arq) against a
real Redis: one Lua call claims and reads jobs, jobs ending together share one finish,
and arq's rules (tries, expired payloads, unknown functions, leases) still hold."""

from __future__ import annotations

import asyncio
from typing import Any

import redis as redis_sync

from receiver.queue._arq import (
    IN_PROGRESS_KEY,
    JOB_KEY,
    RETRY_KEY,
    GivenUp,
    Retry,
    SeamWorker,
    arq_pool,
    func,
    job_deserializer,
    job_serializer,
)
from receiver.redis import RedisConnector

QUEUE = "seam:test"


class Probe(SeamWorker):
    """A seam worker that records what it gives up on and how its finishes were grouped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given_up: list[GivenUp] = []
        self.finish_groups: list[int] = []

    async def give_up(self, job: GivenUp) -> None:
        self.given_up.append(job)

    async def _finish_group(self, group: list[Any]) -> None:
        self.finish_groups.append(len(group))
        await super()._finish_group(group)


async def run_burst(redis_url: str, functions: list[Any], **kwargs: Any) -> Probe:
    worker = Probe(
        functions,
        redis_pool=arq_pool(RedisConnector.from_url(redis_url), queue=QUEUE),
        queue_name=QUEUE,
        burst=True,
        poll_delay=0.01,
        handle_signals=False,
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        keep_result=0,
        **kwargs,
    )
    await asyncio.wait_for(worker.async_run(), 20)
    await worker.close()
    return worker


async def enqueue(redis_url: str, function: str, job_id: str, **kwargs: Any) -> None:
    client = arq_pool(RedisConnector.from_url(redis_url), queue=QUEUE)
    try:
        assert await client.enqueue_job(function, _job_id=job_id, **kwargs) is not None
    finally:
        await client.aclose()


def leftovers(client: redis_sync.Redis) -> list[bytes]:
    keys = [JOB_KEY, RETRY_KEY, IN_PROGRESS_KEY]
    return sorted(k for prefix in keys for k in client.keys(prefix + "*"))


async def test_a_retried_job_counts_its_tries_and_leaves_nothing_behind(
    redis_url: str, redis_sync_client: redis_sync.Redis
) -> None:
    tries: list[int] = []

    async def flaky(ctx: dict[str, Any], **kwargs: Any) -> str:
        tries.append(ctx["job_try"])
        if ctx["job_try"] == 1:
            raise Retry(defer=0.05)
        return "ok"

    await enqueue(redis_url, "flaky", "j1", n=1)
    worker = await run_burst(redis_url, [func(flaky, name="flaky")])
    assert tries == [1, 2]
    assert (worker.jobs_retried, worker.jobs_complete, worker.jobs_failed) == (1, 1, 0)
    assert redis_sync_client.zcard(QUEUE) == 0 and leftovers(redis_sync_client) == []


async def test_jobs_that_end_together_share_one_finish(
    redis_url: str, redis_sync_client: redis_sync.Redis
) -> None:
    started: list[str] = []
    release = asyncio.Event()

    async def gated(ctx: dict[str, Any], **kwargs: Any) -> None:
        started.append(ctx["job_id"])
        if len(started) == 30:
            release.set()
        await asyncio.wait_for(release.wait(), 10)

    for i in range(30):
        await enqueue(redis_url, "gated", f"g{i}")
    worker = await run_burst(redis_url, [func(gated, name="gated")], max_jobs=40)
    assert sorted(started) == sorted(f"g{i}" for i in range(30))
    assert sum(worker.finish_groups) == 30 and len(worker.finish_groups) <= 3
    assert redis_sync_client.zcard(QUEUE) == 0 and leftovers(redis_sync_client) == []


async def test_arqs_rules_give_up_on_expired_unknown_and_too_often_tried_jobs(
    redis_url: str, redis_sync_client: redis_sync.Redis
) -> None:
    async def work(ctx: dict[str, Any], **kwargs: Any) -> None:
        raise AssertionError("none of these jobs may run")

    await enqueue(redis_url, "work", "tried", n=1, _job_try=9)
    await enqueue(redis_url, "nowhere", "unknown", n=2)
    redis_sync_client.zadd(QUEUE, {"expired": 1})  # queued, its payload gone
    worker = await run_burst(redis_url, [func(work, name="work")], max_tries=3)
    given = {g.job_id: g for g in worker.given_up}
    assert sorted(given) == ["expired", "tried", "unknown"]
    assert given["tried"].function == "work" and given["tried"].kwargs == {"n": 1}
    assert "max 3 retries exceeded" in given["tried"].reason
    assert given["unknown"].function is None and "not found" in given["unknown"].reason
    assert given["expired"].function is None and "expired" in given["expired"].reason
    assert redis_sync_client.zcard(QUEUE) == 0 and leftovers(redis_sync_client) == []


async def test_a_run_whose_lease_was_lost_touches_nothing_of_the_job(
    redis_url: str, redis_sync_client: redis_sync.Redis
) -> None:
    async def robbed(ctx: dict[str, Any], **kwargs: Any) -> None:
        ctx["leases"][ctx["job_id"]].lost = True  # as a batch job finds it taken over

    await enqueue(redis_url, "robbed", "r1")
    worker = await run_burst(redis_url, [func(robbed, name="robbed")], max_burst_jobs=1)
    assert worker.finish_groups == []
    # still queued with its payload and lock: the run that owns it now finishes it
    assert redis_sync_client.zscore(QUEUE, "r1") is not None
    assert redis_sync_client.exists(JOB_KEY + "r1", IN_PROGRESS_KEY + "r1") == 2
