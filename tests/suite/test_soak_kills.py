"""The soak's figure for each worker kill (``tests/soak.py``), against a real Redis: how
long the killed workers' work took to be free again and to resume, and a line for every
kill, also one whose workers held nothing or whose work never resumed."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis

from receiver.queue._arq import IN_PROGRESS_KEY, JOB_KEY, RETRY_KEY
from receiver.redis import RedisConnector
from receiver.watches.store import WatchStore
from receiver.worker.liveness import WORKERS_KEY, Liveness, held_jobs_key
from tests.soak import Held, KillFigures, follow_kill, held_at_kill

JOB = "resp:p:resp_1"


async def test_a_kill_is_followed_until_its_work_is_free_then_resumed(redis_url: str) -> None:
    client = Redis.from_url(redis_url)
    dead, live = (
        Liveness(RedisConnector.from_url(redis_url)),
        Liveness(RedisConnector.from_url(redis_url)),
    )
    store = WatchStore(client)
    try:
        for worker in (dead, live):
            await worker.beat()
        # the dead worker holds a job's lock (the job is queued, tried once) and a watch
        await client.set(JOB_KEY + JOB, b"job")
        await client.set(RETRY_KEY + JOB, 1)
        await client.set(IN_PROGRESS_KEY + JOB, f"{dead.worker_id}:1")
        await client.sadd(held_jobs_key(dead.worker_id), IN_PROGRESS_KEY + JOB)
        await store.register("p", "response", "w1", first_poll_in_s=0)
        await store.take_due("p", limit=1, lease_s=300, owner=dead.worker_id)
        held = {dead.worker_id: (await held_at_kill(client))[dead.worker_id]}
        following = asyncio.create_task(
            follow_kill(client, held, at_s=12.0, killed=time.monotonic(), limit_s=10)
        )
        await asyncio.sleep(1)
        now_ms = await live.beat()
        await client.zadd(WORKERS_KEY, {dead.worker_id: now_ms - 25_000})
        assert await live.reap(now_ms) == [(dead.worker_id, 1, 1)]  # free, not resumed yet
        await asyncio.sleep(1)
        # a live worker claims the job again (its try counted) and polls the watch
        await client.set(IN_PROGRESS_KEY + JOB, f"{live.worker_id}:2")
        await client.incr(RETRY_KEY + JOB)
        await store.take_due("p", limit=1, lease_s=300, owner=live.worker_id)
        kill = await following
    finally:
        await client.aclose()
        for worker in (dead, live):
            await worker.stop()
    assert (kill.locks, kill.watches, kill.left) == (1, 1, 0)
    assert kill.free_s is not None and 0.8 < kill.free_s < 1.8
    assert kill.resumed_s is not None and 1.8 < kill.resumed_s < 2.8
    assert len(kill.reaped_s) == 1 and abs(kill.reaped_s[0] - kill.free_s) < 0.5
    assert kill.line(1).startswith(
        f"worker kill 1 at 12 s: 1 job lock(s) and 1 watch(es) held; all free after "
        f"{kill.free_s:.1f} s, all resumed after {kill.resumed_s:.1f} s"
    )


async def test_a_finished_job_and_a_landed_watch_count_as_resumed(redis_url: str) -> None:
    client = Redis.from_url(redis_url)
    store = WatchStore(client)
    try:
        await store.register("p", "response", "w1", first_poll_in_s=0)
        [watch] = await store.take_due("p", limit=1, lease_s=300, owner="w_dead")
        assert await store.claim_landing(watch, "completed", lease_s=30)
        held: Held = {
            "w_dead": ({IN_PROGRESS_KEY.encode() + b"gone": None}, {"p response:w1": b"1"})
        }
        await store.end(watch, "landed")  # landed by the worker before it died
        kill = await follow_kill(client, held, at_s=3.0, killed=time.monotonic(), limit_s=2)
    finally:
        await client.aclose()
    assert kill.free_s is not None and kill.resumed_s is not None and kill.resumed_s < 0.5
    assert kill.left == 0


def test_every_kill_has_its_line() -> None:
    assert KillFigures(at_s=40.2).line(1) == (
        "worker kill 1 at 40 s: the killed workers held nothing"
    )
    never = KillFigures(at_s=90, locks=2, watches=1, free_s=21.3, left=1)
    assert never.line(2) == (
        "worker kill 2 at 90 s: 2 job lock(s) and 1 watch(es) held; all free after 21.3 s, "
        "1 of them not resumed 120 s after the kill"
    )
    stuck = KillFigures(at_s=90, locks=1, left=1, limit_s=60)
    assert stuck.line(3).endswith("not all free 60 s after the kill, 1 of them not resumed")
