"""The shared rate limit against real Redis, from two processes at once."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time

from redis.asyncio import Redis

from receiver.providers.ratelimit import RateLimiter
from tests.limited_provider import max_in_any_second

_GRANTS = """
import asyncio, json, sys, time
from redis.asyncio import Redis
from receiver.providers.ratelimit import RateLimiter

async def main(url, rate, seconds):
    redis = Redis.from_url(url)
    limiter = RateLimiter(redis, "sim", rate)
    stamps = []
    stop = time.time() + seconds
    async def caller():
        while time.time() < stop:
            await limiter.acquire(limit_s=10)
            stamps.append(time.time())
    await asyncio.gather(*(caller() for _ in range(20)))
    await redis.aclose()
    print(json.dumps(stamps))

asyncio.run(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3])))
"""


def test_two_processes_never_exceed_the_rate_in_any_one_second_window(redis_url):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GRANTS, redis_url, "50", "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    stamps: list[float] = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        stamps += json.loads(out)
    span = max(stamps) - min(stamps)
    assert len(stamps) >= 125  # the budget is used (less the 10 % jitter allowance)...
    assert len(stamps) <= 50 * span + 1  # ...not exceeded overall...
    assert max_in_any_second(stamps) <= 50  # ...nor in any one-second window


async def test_a_pause_holds_every_caller_and_a_slot_too_far_is_not_reserved(redis_url):
    redis = Redis.from_url(redis_url)
    try:
        limiter = RateLimiter(redis, "sim", 100)
        await limiter.acquire()
        await limiter.pause(0.5)  # a 429 with Retry-After: 0.5
        started = time.monotonic()
        await limiter.acquire()
        assert time.monotonic() - started >= 0.45
        await limiter.pause(30)
        assert await limiter.reserve(limit_s=5) is None  # nothing reserved...
        other = RateLimiter(redis, "other", 100)
        assert await other.reserve() == 0  # ...and other providers are not held
    finally:
        await redis.aclose()


async def test_callers_get_their_slots_in_order(redis_url):
    redis = Redis.from_url(redis_url)
    try:
        limiter = RateLimiter(redis, "sim", 20)
        waits = [await limiter.reserve() for _ in range(5)]
        assert waits[0] == 0
        assert all(w is not None for w in waits)
        gaps = [b - a for a, b in itertools.pairwise(waits)]  # type: ignore[operator]
        assert all(0.054 <= g <= 0.056 for g in gaps), gaps  # 1/20 s plus the allowance
        await asyncio.sleep(0)
    finally:
        await redis.aclose()


async def test_a_pause_that_begins_while_callers_wait_holds_their_slots_too(redis_url):
    """Callers already holding a slot when a 429 arrives do not go inside its Retry-After."""
    redis = Redis.from_url(redis_url)
    try:
        limiter = RateLimiter(redis, "sim-held", 5)  # slots 0.22 s apart
        await limiter.acquire()
        started = time.monotonic()
        waiting = [asyncio.create_task(limiter.acquire(limit_s=10)) for _ in range(3)]
        await asyncio.sleep(0.05)  # all three have booked their slot and are asleep
        await limiter.pause(1.0)
        await asyncio.gather(*waiting)
        went = time.monotonic() - started
        assert went >= 0.95, f"a held caller went {went:.2f} s in, inside the 1 s pause"
    finally:
        await redis.aclose()
