"""A batch's progress record carries its version: a worker reads its own and older ones
(none reads as 1) and refuses one a newer nopoll wrote, naming the version."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from receiver.batches.progress import BatchState
from receiver.queue.jobs import STATE_VERSION, PayloadVersionError


async def test_a_newer_progress_record_is_refused_and_an_older_one_read(redis_url):
    client = Redis.from_url(redis_url)
    state = BatchState.of(client, "p", "batch_v", ttl_s=60, job_expiry_ms=60_000)
    try:
        await client.delete(state.key)
        await client.hset(state.key, "cs", "100")  # written before versions: read as 1
        assert (await state.load(["db"])).bounds is not None
        await client.delete(state.key)
        await state.begin(100)
        assert await client.hget(state.key, "v") == str(STATE_VERSION).encode()
        await client.hset(state.key, "v", str(STATE_VERSION + 1))
        with pytest.raises(PayloadVersionError, match="batch progress version 2") as caught:
            await state.load(["db"])
        assert caught.value.mark == f"state:{STATE_VERSION + 1}"
    finally:
        await client.delete(state.key)
        await client.aclose()
