"""SharedTrips, the worker's and the API's Redis coalescer, against a real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ResponseError

from receiver.queue.trips import RoundTrips, SharedTrips

ECHO = "return {KEYS[1], ARGV[1]}"
"""A script: its key and its argument back."""


@pytest.fixture
def trip_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    original = RoundTrips.run

    async def run(trips: RoundTrips, commands: list[tuple[Any, ...]]) -> list[Any]:
        sizes.append(len(commands))
        return await original(trips, commands)

    monkeypatch.setattr(RoundTrips, "run", run)
    return sizes


async def test_callers_share_one_trip_out_at_a_time_and_each_gets_its_own_replies(
    redis, trip_sizes
):
    trips = SharedTrips(redis, max_in_flight=1)
    await trips.run([trips.evalsha(ECHO, 1, "t:warm", "up")])  # the script loaded
    trip_sizes.clear()

    async def caller(i: int) -> list[Any]:
        return await trips.run(
            [
                ("SET", f"t:{i}", i),
                trips.evalsha(ECHO, 1, f"t:{i}", f"arg{i}"),
                ("INCR", "t:shared"),
            ]
        )

    replies = await asyncio.gather(*(caller(i) for i in range(40)))
    for i, (set_reply, echo, incr) in enumerate(replies):
        assert set_reply in (b"OK", True) and echo == [f"t:{i}".encode(), f"arg{i}".encode()]
        assert isinstance(incr, int)
    assert sorted(r[2] for r in replies) == list(range(1, 41))  # every INCR ran once
    assert sum(trip_sizes) == 40 * 3 and len(trip_sizes) < 40  # several callers per trip


async def test_an_error_reply_is_the_callers_own_and_the_others_succeed(redis):
    trips = SharedTrips(redis, max_in_flight=1)
    await redis.set("t:text", "not a number")
    bad, good = await asyncio.gather(
        trips.run([("INCR", "t:text")]), trips.run([("INCR", "t:count")])
    )
    assert isinstance(bad[0], ResponseError) and good == [1]


async def test_a_redis_that_lost_its_scripts_gets_them_again(redis):
    trips = SharedTrips(redis)
    [first] = await trips.run([trips.evalsha(ECHO, 1, "t:k", "one")])
    await redis.script_flush()  # as after a Redis restart
    [second] = await trips.run([trips.evalsha(ECHO, 1, "t:k", "two")])
    assert first == [b"t:k", b"one"] and second == [b"t:k", b"two"]
