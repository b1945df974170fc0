"""The feed store against a real Redis: one holder per account at a time, a cursor moved
only by its holder, the streams followed for their window."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from receiver.feeds.store import ACCOUNT_FEED, NEW, STREAM_KEEP_S, FeedStore, feed_key
from receiver.redis import RedisConnector


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = RedisConnector.from_url(redis_url).client("api")
    yield client
    await client.aclose()


async def test_one_holder_at_a_time_until_its_hold_lapses_or_is_released(redis) -> None:
    store = FeedStore(redis)
    assert await store.take("sim", "a", 0.5)
    assert await store.take("sim", "a", 0.5)  # the holder renews
    assert not await store.take("sim", "b", 0.5)  # another waits
    assert await store.take("sim@team-a", "b", 0.5)  # another account is another hold
    await store.release("sim", "b")  # not b's to release
    assert not await store.take("sim", "b", 0.5)
    await asyncio.sleep(0.6)  # a holder killed: its hold lapses
    assert await store.take("sim", "b", 5)
    await store.release("sim", "b")
    assert await store.take("sim", "a", 5)
    assert (await store.state("sim")).holder == "a"


async def test_a_cursor_moves_only_by_its_holder(redis) -> None:
    store = FeedStore(redis)
    assert await store.take("sim", "a", 5)
    assert await store.advance("sim", "a", ACCOUNT_FEED, "c1", landed=3, last_completed_at=100.0)
    assert not await store.advance("sim", "b", ACCOUNT_FEED, "c9", landed=9, last_completed_at=None)
    state = await store.state("sim")
    assert state.cursors == {ACCOUNT_FEED: "c1"} and state.landed == 3
    assert state.last_completed_at == 100.0 and state.read_at is not None
    shown = state.to_dict(now=110.0)
    assert shown["feeds"] == [{"stream": None, "cursor": "c1"}] and shown["lag_s"] == 10.0


async def test_streams_are_followed_from_their_start_for_their_window(redis) -> None:
    store = FeedStore(redis)
    assert await store.cursors("sim") == {ACCOUNT_FEED: None}  # never read
    await store.follow_stream("sim", "s-1")
    await store.follow_stream("sim", "s-old")
    old = time.time() - STREAM_KEEP_S - 1
    await redis.zadd(feed_key("sim", "streams"), {"s-old": old})
    assert await store.cursors("sim") == {ACCOUNT_FEED: None, "s-1": NEW}
    assert await redis.zrange(feed_key("sim", "streams"), 0, -1) == [b"s-1"]
    await store.follow_stream("sim", "s-1")  # a rerun of the same file: the cursor stays
    assert await store.take("sim", "a", 5)
    assert await store.advance("sim", "a", "s-1", "c5", landed=1, last_completed_at=None)
    await store.follow_stream("sim", "s-1")
    assert (await store.cursors("sim"))["s-1"] == "c5"
