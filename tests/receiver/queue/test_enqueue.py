"""The enqueue coalescer and the webhook-id memory, against a real Redis.

Time is the Enqueuer's ``clock``: the dedupe window (days) is walked through in a test,
while the keys' own TTLs (relative) keep them alive in real time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from receiver.app import create_app
from receiver.metrics import Metrics
from receiver.queue.enqueue import (
    JOBS_QUEUE,
    EnqueueOutcome,
    Enqueuer,
    QueueBusy,
)
from receiver.queue.trips import RoundTrips
from receiver.redis import RedisConnector
from tests.receiver.helpers import WEEK_S, Clock, job
from tests.servers import ValkeyProcess

WINDOW_MS = WEEK_S * 1000


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def enqueuer(redis, clock) -> Enqueuer:
    return Enqueuer(redis, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S, clock=clock)


class TripSpy:
    """Wraps RoundTrips.run: records each trip's size; can hold or fail chosen trips."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        self.gate: asyncio.Event | None = None
        self.fail_if: Any = None
        original = RoundTrips.run

        async def run(trips: RoundTrips, commands: list[tuple[Any, ...]]) -> list[Any]:
            self.sizes.append(len(commands))
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_if is not None and self.fail_if(commands):
                raise RedisConnectionError("injected: this round trip broke")
            return await original(trips, commands)

        monkeypatch.setattr(RoundTrips, "run", run)


async def until(condition: Any, limit_s: float = 5.0) -> None:
    for _ in range(int(limit_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


# --- the coalescer ---------------------------------------------------------------------


async def test_concurrent_enqueues_share_round_trips_and_each_gets_its_own_outcome(
    enqueuer, monkeypatch, redis
):
    spy = TripSpy(monkeypatch)
    new = [job(f"msg_new_{i}") for i in range(60)]
    twice = [job("msg_twice"), job("msg_twice")]  # the same delivery twice at once
    riders = [job(f"msg_rider_{i}", response_id="r_shared") for i in range(3)]
    outcomes = await asyncio.gather(*(enqueuer.enqueue(j) for j in [*new, *twice, *riders]))
    assert outcomes[:60] == [EnqueueOutcome.ENQUEUED] * 60
    assert sorted(outcomes[60:62]) == [EnqueueOutcome.DUPLICATE, EnqueueOutcome.ENQUEUED]
    assert sorted(outcomes[62:]) == [EnqueueOutcome.ENQUEUED] + [EnqueueOutcome.ALREADY_QUEUED] * 2
    assert sum(spy.sizes) == 65 and len(spy.sizes) < 65 / 4  # shared, several per trip
    assert await redis.zcard(JOBS_QUEUE) == 62


async def test_several_round_trips_are_in_flight_at_once(redis, clock, monkeypatch):
    spy = TripSpy(monkeypatch)
    spy.gate = asyncio.Event()
    enq = Enqueuer(redis, dedupe_ttl_s=60, job_expiry_s=3600, max_in_flight=3, clock=clock)
    tasks = [asyncio.create_task(enq.enqueue(job(f"msg_{i}"))) for i in range(200)]
    await until(lambda: len(spy.sizes) >= 3)
    await asyncio.sleep(0.05)  # no fourth trip starts meanwhile
    assert len(spy.sizes) == 3  # three trips wait on Redis together; the rest wait for one
    assert enq.pending == 200 - sum(spy.sizes) > 0
    spy.gate.set()
    assert set(await asyncio.gather(*tasks)) == {EnqueueOutcome.ENQUEUED}
    assert sum(spy.sizes) == 200


async def test_a_failing_round_trip_fails_only_its_callers(enqueuer, monkeypatch, redis):
    spy = TripSpy(monkeypatch)
    spy.fail_if = lambda commands: any("msg_doomed" in c[3] for c in commands)
    doomed = asyncio.create_task(enqueuer.enqueue(job("msg_doomed")))
    await until(lambda: len(spy.sizes) == 1)  # its trip left alone
    others = [asyncio.create_task(enqueuer.enqueue(job(f"msg_ok_{i}"))) for i in range(20)]
    with pytest.raises(RedisConnectionError):
        await doomed
    assert set(await asyncio.gather(*others)) == {EnqueueOutcome.ENQUEUED}
    assert spy.sizes[0] == 1 and sum(spy.sizes) == 21
    spy.fail_if = None
    # the failed one was not remembered: its retry is queued, not taken for a duplicate
    assert await enqueuer.enqueue(job("msg_doomed")) is EnqueueOutcome.ENQUEUED
    assert await enqueuer.enqueue(job("msg_after")) is EnqueueOutcome.ENQUEUED
    assert await redis.zcard(JOBS_QUEUE) == 22


async def test_a_flood_beyond_the_pending_bound_is_refused_at_once(redis, clock, monkeypatch):
    spy = TripSpy(monkeypatch)
    spy.gate = asyncio.Event()
    enq = Enqueuer(
        redis, dedupe_ttl_s=60, job_expiry_s=3600, max_batch=5, max_in_flight=1, clock=clock
    )  # bound: one more batch (5) may wait while one is in flight
    flood = [asyncio.create_task(enq.enqueue(job(f"msg_{i}"))) for i in range(5000)]
    await until(lambda: len(spy.sizes) == 1)
    refused = [t for t in flood if t.done() and isinstance(t.exception(), QueueBusy)]
    waiting = [t for t in flood if not t.done()]
    assert 0 < len(waiting) <= 10 and len(refused) == 5000 - len(waiting)
    assert enq.pending <= 5  # what the Enqueuer holds does not grow with the flood
    more = [asyncio.create_task(enq.enqueue(job(f"msg_more_{i}"))) for i in range(1000)]
    await until(lambda: sum(t.done() for t in more) >= 995)  # refused at once
    waiting += [t for t in more if not t.done()]
    assert sum(isinstance(t.exception(), QueueBusy) for t in more if t.done()) >= 995
    assert len(waiting) <= 10 and enq.pending <= 5  # in flight + one more batch
    spy.gate.set()
    assert set(await asyncio.gather(*waiting)) == {EnqueueOutcome.ENQUEUED}
    assert await redis.zcard(JOBS_QUEUE) == len(waiting)
    assert await enq.enqueue(job("msg_later")) is EnqueueOutcome.ENQUEUED  # it recovers


async def test_the_app_answers_503_when_the_queue_is_busy(
    make_settings, redis_url, redis, signed_callback
):
    settings = make_settings(redis_url=redis_url)
    busy = Enqueuer(redis, dedupe_ttl_s=60, job_expiry_s=3600, max_pending=0)
    app = create_app(settings, redis=redis, metrics=Metrics(), enqueuer=busy)
    body, headers = signed_callback("resp_busy")
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://nopoll") as client:
        r = await client.post("/webhooks/sim", content=body, headers=headers)
    assert r.status_code == 503 and r.json() == {"error": "queue busy, retry later"}
    assert await redis.zcard(JOBS_QUEUE) == 0


@pytest.fixture
def private_redis():
    """A Redis of this test's own: SCRIPT FLUSH and restarts must not touch the shared one."""
    server = ValkeyProcess(appendonly=True).start()
    yield server
    server.stop()


async def test_noscript_after_script_flush_is_reloaded(private_redis, clock):
    client = RedisConnector.from_url(private_redis.url).client("api")
    try:
        enq = Enqueuer(client, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S, clock=clock)
        assert await enq.enqueue(job("msg_1")) is EnqueueOutcome.ENQUEUED
        await client.script_flush()
        outcomes = await asyncio.gather(*(enq.enqueue(job(f"msg_{i}")) for i in range(1, 30)))
        assert outcomes == [EnqueueOutcome.DUPLICATE] + [EnqueueOutcome.ENQUEUED] * 28
        assert await client.zcard(JOBS_QUEUE) == 29
    finally:
        await client.aclose()


async def test_a_redis_restart_is_ridden_out(private_redis, clock):
    client = RedisConnector.from_url(private_redis.url).client("api")
    try:
        enq = Enqueuer(client, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S, clock=clock)
        assert await enq.enqueue(job("msg_before")) is EnqueueOutcome.ENQUEUED
        private_redis.restart()  # scripts and connections are gone, the data (AOF) is not
        assert await enq.enqueue(job("msg_after")) is EnqueueOutcome.ENQUEUED
        assert await enq.enqueue(job("msg_before")) is EnqueueOutcome.DUPLICATE
        assert await client.zcard(JOBS_QUEUE) == 2
    finally:
        await client.aclose()
