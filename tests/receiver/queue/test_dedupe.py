"""Remembering webhook-ids for the dedupe window (time-bucketed digest hashes), against a
real Redis. The Enqueuer's ``clock`` walks through the window; keys' TTLs are relative,
so they stay alive in real time meanwhile."""

from __future__ import annotations

import asyncio

from receiver.queue.enqueue import JOBS_QUEUE, EnqueueOutcome, Enqueuer
from receiver.redis import RedisConnector
from tests.receiver.helpers import WEEK_S, Clock, job

DAY_S = 86_400
HEAD = "nopoll:seen:@head"
DUP, NEW = EnqueueOutcome.DUPLICATE, EnqueueOutcome.ENQUEUED


def at_day_end(day: int = 19_675) -> float:
    """A moment 1.25 s before a bucket (day) boundary, with a fraction of a second."""
    return (day + 1) * DAY_S - 1.25


async def forget_job(redis, webhook_id: str) -> None:
    """As if the job ran: only the webhook-id memory can make the next copy a duplicate."""
    await redis.delete(f"arq:job:resp:p:r_{webhook_id}")
    await redis.zrem(JOBS_QUEUE, f"resp:p:r_{webhook_id}")


async def test_a_duplicate_is_found_across_bucket_boundaries(redis):
    clock = Clock(at_day_end())
    enq = Enqueuer(redis, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S, clock=clock)
    assert await enq.enqueue(job("msg_a")) is NEW
    await forget_job(redis, "msg_a")
    start = clock.t
    for later_s in (1.0, 2.0, DAY_S, 3 * DAY_S + 7, 6 * DAY_S, WEEK_S - 60):
        clock.t = start + later_s
        await enq.enqueue(job(f"msg_fill_{later_s}"))  # new buckets open on the way
        assert await enq.enqueue(job("msg_a")) is DUP, later_s
    assert len((await redis.hget(HEAD, "live")).split()) >= 5  # one segment per bucket


async def test_an_id_is_remembered_right_up_to_the_end_of_the_window(redis):
    clock = Clock(at_day_end() + 0.5)
    enq = Enqueuer(redis, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S, clock=clock)
    first = clock.t
    assert await enq.enqueue(job("msg_w")) is NEW
    await forget_job(redis, "msg_w")
    clock.t = first + 72 * 3600  # providers retry for up to 72 hours
    assert await enq.enqueue(job("msg_w")) is DUP
    clock.t = first + WEEK_S - 0.001  # the last millisecond of the window
    assert await enq.enqueue(job("msg_w")) is DUP
    clock.t = first + WEEK_S + 1.0  # older than the window (to the second): new again
    assert await enq.enqueue(job("msg_w")) is NEW
    await forget_job(redis, "msg_w")
    clock.t += 1.0
    assert await enq.enqueue(job("msg_w")) is DUP  # and remembered anew


async def test_an_id_older_than_the_window_is_new_again_after_its_segment_expired(redis):
    clock = Clock(at_day_end())
    enq = Enqueuer(redis, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S, clock=clock)
    assert await enq.enqueue(job("msg_old")) is NEW
    await forget_job(redis, "msg_old")
    clock.t += WEEK_S + 2 * DAY_S  # its whole bucket is past the window
    assert await enq.enqueue(job("msg_old")) is NEW
    live = (await redis.hget(HEAD, "live")).split()
    assert len(live) == 1  # the expired segment was dropped from the lookups


async def test_two_racing_copies_enqueue_exactly_once(redis_url):
    clients = [
        RedisConnector.from_url(redis_url).client("api"),
        RedisConnector.from_url(redis_url).client("api"),
    ]
    try:
        # two API processes, each with its own Enqueuer and connections
        enqs = [Enqueuer(c, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S) for c in clients]
        for n in range(5):
            copies = [e.enqueue(job(f"msg_race_{n}")) for e in enqs for _ in range(4)]
            outcomes = await asyncio.gather(*copies)
            assert sorted(outcomes) == [DUP] * 7 + [NEW], n
        assert await clients[0].zcard(JOBS_QUEUE) == 5
    finally:
        for c in clients:
            await c.aclose()


async def test_the_same_id_from_two_providers_is_two_ids(redis):
    enq = Enqueuer(redis, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S)
    assert await enq.enqueue(job("msg_same", provider="a")) is NEW
    assert await enq.enqueue(job("msg_same", provider="b")) is NEW
    assert await enq.enqueue(job("msg_same", provider="a")) is DUP


async def test_full_segments_open_more_and_every_id_stays_remembered(redis):
    clock = Clock(at_day_end(19_000) - DAY_S / 2)
    enq = Enqueuer(redis, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S, clock=clock)
    ids = [f"msg_{i}" for i in range(4000)]
    for i in range(0, len(ids), 500):  # 4000 ids in 4 s: far more than a first segment holds
        clock.t += 0.5
        assert set(await asyncio.gather(*(enq.enqueue(job(w)) for w in ids[i : i + 500]))) == {NEW}
    assert len((await redis.hget(HEAD, "live")).split()) >= 2
    clock.t += 2 * DAY_S
    for i in range(0, len(ids), 1000):
        assert set(await asyncio.gather(*(enq.enqueue(job(w)) for w in ids[i : i + 1000]))) == {DUP}


async def test_ids_live_in_small_expiring_hashes_not_a_key_each(redis):
    clock = Clock(at_day_end())
    window_s = 70  # buckets of 10 s: 40,000 ids at 1,000/s cross four of them
    enq = Enqueuer(redis, dedupe_ttl_s=window_s, job_expiry_s=3600, clock=clock)
    for i in range(0, 40_000, 500):
        clock.t += 0.5
        await asyncio.gather(
            *(enq.enqueue(job(f"m{j}", response_id="r")) for j in range(i, i + 500))
        )
    keys = [k async for k in redis.scan_iter(match="nopoll:seen:@*", count=1000)]
    assert 1 < len(keys) < 40_000 / 16
    pipe = redis.pipeline(transaction=False)
    for k in keys:
        pipe.type(k)
        pipe.hlen(k)
        pipe.pttl(k)
    replies = await pipe.execute()
    shards = [
        (n, ttl)
        for k, t, n, ttl in zip(keys, *[iter(replies)] * 3, strict=True)
        if k != HEAD.encode()
    ]
    assert all(n <= 128 for n, _ in shards)  # Redis's default listpack limit: compact
    assert sum(n for n, _ in shards) == 40_000
    # every shard expires by itself, within the window plus one bucket (and a second)
    assert all(0 < ttl <= (window_s + 10 + 1) * 1000 for _, ttl in shards)


async def test_ids_remembered_by_older_versions_are_honoured(redis):
    await redis.set("nopoll:seen:p:msg_legacy", "1", px=3_600_000)
    enq = Enqueuer(redis, dedupe_ttl_s=WEEK_S, job_expiry_s=WEEK_S)
    assert await enq.enqueue(job("msg_legacy")) is DUP
    assert await enq.enqueue(job("msg_fresh")) is NEW
    assert await redis.zcard(JOBS_QUEUE) == 1
