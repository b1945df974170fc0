"""Fixtures shared by the queue tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from receiver.redis import RedisConnector


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """A client of the tests' Redis database, closed after the test."""
    client = RedisConnector.from_url(redis_url).client("api")
    yield client
    await client.aclose()
