"""Worker liveness against real Redis: a dead worker's leases are released exactly (only
what it still holds), a live one's never, and a watch handed on stays its new taker's."""

from __future__ import annotations

import asyncio
import sys
import time

from redis.asyncio import Redis

from receiver.queue._arq import IN_PROGRESS_KEY
from receiver.redis import RedisConnector
from receiver.watches.store import WatchStore
from receiver.worker.liveness import (
    DEAD_AFTER_S,
    WORKERS_KEY,
    Liveness,
    claim_identity,
    held_jobs_key,
    process_key,
)


async def test_a_dead_workers_leases_are_released_and_a_live_workers_kept(redis_url):
    client = Redis.from_url(redis_url)
    dead, live = (
        Liveness(RedisConnector.from_url(redis_url)),
        Liveness(RedisConnector.from_url(redis_url)),
    )
    store = WatchStore(client)
    try:
        for w in (dead, live):
            await w.beat()
        # the dead worker holds a job lock, one lock already taken over, and a watch
        for job, token in (("j1", f"{dead.worker_id}:1"), ("j2", f"{live.worker_id}:2")):
            await client.set(IN_PROGRESS_KEY + job, token, px=600_000)
            await client.sadd(held_jobs_key(dead.worker_id), IN_PROGRESS_KEY + job)
        await store.register_all("p", "response", ["w1", "w2"], first_poll_in_s=0)
        [w1] = await store.take_due("p", limit=1, lease_s=300, owner=dead.worker_id)
        [w2] = await store.take_due("p", limit=1, lease_s=300, owner=live.worker_id)
        now_ms = await live.beat()
        await client.zadd(WORKERS_KEY, {dead.worker_id: now_ms - 25_000})  # silent 25 s

        assert await live.reap(now_ms) == [(dead.worker_id, 1, 1)]
        assert await client.get(IN_PROGRESS_KEY + "j1") is None
        assert await client.get(IN_PROGRESS_KEY + "j2") == f"{live.worker_id}:2".encode()
        assert await client.zscore(WORKERS_KEY, dead.worker_id) is None
        assert await client.zscore(WORKERS_KEY, live.worker_id) is not None
        # the dead worker's watch is due now for anyone; the live one's is still leased
        [again] = await store.take_due("p", limit=5, lease_s=300, owner=live.worker_id)
        assert again.id == w1.id and again.owner == live.worker_id
        # the old taker can neither reschedule nor land the watch handed on
        await store.reschedule(w1, in_s=60, status="in_progress")
        assert not await store.claim_landing(w1, "completed", lease_s=30)
        assert (await store.get("p", "response", w1.id)).owner == live.worker_id
        assert await store.claim_landing(again, "completed", lease_s=30)
        assert w2.owner == live.worker_id
    finally:
        await client.aclose()
        for w in (dead, live):
            await w.stop()


async def test_a_worker_within_the_bound_is_not_reaped_and_stop_hands_back(redis_url):
    client = Redis.from_url(redis_url)
    a, b = (
        Liveness(RedisConnector.from_url(redis_url)),
        Liveness(RedisConnector.from_url(redis_url)),
    )
    store = WatchStore(client)
    try:
        await a.beat()
        now_ms = await b.beat()
        await store.register("p", "response", "w1", first_poll_in_s=0)
        [w1] = await store.take_due("p", limit=1, lease_s=300, owner=a.worker_id)
        # a beat 7 s ago by Redis's clock (the bound is 8 s): alive, nothing is released
        assert DEAD_AFTER_S == 8.0
        assert await b.reap(now_ms + 7_000) == []
        assert (await store.get("p", "response", "w1")).state == "polling"
        # a stops (SIGTERM): its watch is due at once, owner cleared, and a is gone
        await a.stop()
        watch = await store.get("p", "response", "w1")
        assert (watch.state, watch.owner) == ("pending", None)
        assert await client.zscore(WORKERS_KEY, a.worker_id) is None
        assert [w.id for w in await store.take_due("p", limit=1, lease_s=300)] == [w1.id]
    finally:
        await client.aclose()
        await b.stop()


async def _holding(client: Redis, worker_id: str, job: str) -> None:
    token = f"{worker_id}:1"
    await client.set(IN_PROGRESS_KEY + job, token, px=600_000)
    await client.sadd(held_jobs_key(worker_id), IN_PROGRESS_KEY + job)
    await client.zadd(WORKERS_KEY, {worker_id: time.time() * 1000})  # it beat just now


async def test_a_worker_restarted_under_its_id_takes_back_what_its_dead_life_held(redis_url):
    """The previous life ran on this host as a process now gone (killed): its job lock is
    released at once, though its beat is fresh, and the id is this process's."""
    client = Redis.from_url(redis_url)
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await asyncio.wait_for(gone.wait(), 10)
    try:
        first = await claim_identity(client, "w-restart")
        assert first == "w-restart"
        # its life: the process key names a pid that no longer runs, holding one job
        host, _, _ = (await client.get(process_key("w-restart"))).decode().split("/")
        await client.set(process_key("w-restart"), f"{host}/{gone.pid}/0")
        await _holding(client, "w-restart", "job-a")
        assert await claim_identity(client, "w-restart") == "w-restart"
        assert await client.get(IN_PROGRESS_KEY + "job-a") is None
        assert await client.zscore(WORKERS_KEY, "w-restart") is None
    finally:
        await client.delete(process_key("w-restart"), held_jobs_key("w-restart"))
        await client.aclose()


async def test_an_id_in_use_by_a_live_process_is_never_shared(redis_url):
    """Two workers given one id: the second runs under a new id and the first keeps what it
    holds, on this host (the pid runs) and from another host (its beat is fresh); another
    host's worker silent past the bound is dead and its id is taken back."""
    client = Redis.from_url(redis_url)
    alive = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(30)"
    )
    try:
        await claim_identity(client, "w-twice")
        host, _, _ = (await client.get(process_key("w-twice"))).decode().split("/")
        await client.set(process_key("w-twice"), f"{host}/{alive.pid}/0")
        await _holding(client, "w-twice", "job-b")
        second = await claim_identity(client, "w-twice")
        assert second != "w-twice"
        assert await client.get(IN_PROGRESS_KEY + "job-b") == b"w-twice:1"
        assert (await client.get(process_key("w-twice"))).decode() == f"{host}/{alive.pid}/0"

        await client.set(process_key("w-twice"), "elsewhere/1/0")  # another host, beating
        assert await claim_identity(client, "w-twice") != "w-twice"
        assert await client.get(IN_PROGRESS_KEY + "job-b") == b"w-twice:1"
        await client.set(process_key("w-twice"), "elsewhere/1/0")  # silent for 9 s
        await client.zadd(WORKERS_KEY, {"w-twice": time.time() * 1000 - 9_000})
        assert await claim_identity(client, "w-twice") == "w-twice"
        assert await client.get(IN_PROGRESS_KEY + "job-b") is None
    finally:
        alive.kill()
        await asyncio.wait_for(alive.wait(), 10)
        await client.delete(process_key("w-twice"), held_jobs_key("w-twice"))
        await client.zrem(WORKERS_KEY, "w-twice")
        await client.aclose()


class _CutRedis(Liveness):
    """A heartbeat whose Redis client turns the cancel that stops it into a connection
    error, as redis-py does when the cancel cuts a connect or a read short (seen in CI: a
    worker refusing an evicting Redis said "shutting down" and never exited)."""

    async def beat(self) -> int:
        now = await super().beat()
        if asyncio.current_task() is not self._task:  # start()'s own first beat
            return now
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise ConnectionError("Connection closed by server.") from None
        return now


async def test_the_heartbeat_stops_when_its_client_turns_the_stop_into_an_error(redis_url):
    liveness = _CutRedis(RedisConnector.from_url(redis_url), beat_s=0.05)
    try:
        await liveness.start()
        await asyncio.sleep(0.2)  # in its second beat, cut short by the stop
        await asyncio.wait_for(liveness.stop(), 5)
    finally:
        await liveness.redis.aclose()
