"""A tenant's token catching up on the results stream reads its tenant's entries only,
not every tenant's retained stream: ten team-a reconnects from the start used to read the
whole stream each (the API's CPU at 79 %, callbacks' p99 10x). Real server and Redis;
what is read is measured by Redis's own count of bytes sent."""

from __future__ import annotations

import httpx
import orjson
from redis import asyncio as redis_asyncio

from sinks.results import STREAM, TENANT_SUFFIX
from tests.receiver.helpers import TOKEN, TOKEN_A, bearer, envelope, sink_for
from tests.receiver.results.test_results_stream import sse
from tests.servers import running_api

OTHERS = 2000  # the operator's and team-b's results, ~1 KB each
MINE = 3


async def _bytes_sent(redis) -> int:
    return int((await redis.info("stats"))["total_net_output_bytes"])


async def _catch_up(base: str, token: str, want: int) -> list[str]:
    """(ids of) the events a stream from the start sends, until ``want`` came."""
    got: list[str] = []
    async with httpx.AsyncClient(base_url=base, headers=bearer(token), timeout=10) as client:
        async for _, event_id, _ in sse(client, last_event_id="0-0"):
            got.append(event_id)
            if len(got) == want:
                break
    return got


async def test_a_tenant_catching_up_reads_only_its_entries(results_settings, redis_url):
    body = "x" * 1000
    async with sink_for(redis_url, stream_max_entries=10_000) as published:
        await _publish(published, body)
    redis_client = redis_asyncio.Redis.from_url(redis_url)
    try:
        await _check(results_settings, redis_url, redis_client)
    finally:
        await redis_client.aclose()


async def _publish(published, body: str) -> None:
    for start in range(0, OTHERS, 500):
        await published.write(
            [
                envelope(f"o{i}", tenant=("default", "team-b")[i % 2], output_text=body)
                for i in range(start, start + 500)
            ]
        )
    for i in range(MINE):
        await published.write([envelope(f"mine{i}", tenant="team-a", output_text=body)])


async def _check(results_settings, redis_url, redis_client) -> None:
    async with running_api(results_settings(), redis_url) as (base, _):
        before = await _bytes_sent(redis_client)
        mine = await _catch_up(base, TOKEN_A, MINE)
        read = await _bytes_sent(redis_client) - before
        assert len(mine) == MINE
        assert read < 100_000, f"{read} bytes read from Redis for {MINE} events"
        # the operator's token, on every tenant, still sees everything, in the same ids
        everything = await _catch_up(base, TOKEN, OTHERS + MINE)
        assert everything[-MINE:] == mine


async def test_a_tenants_trimmed_history_sends_reset_first(results_settings, redis_url):
    """Reading its own stream, a tenant's token still learns exactly what it missed: the
    reset names its own newest trimmed entry, and resuming from there has no gap."""
    redis = redis_asyncio.Redis.from_url(redis_url)
    own = STREAM + TENANT_SUFFIX + "team-a"
    async with (
        sink_for(redis_url, stream_max_entries=100) as sink,
        running_api(results_settings(), redis_url) as (base, _),
    ):
        await sink.write([envelope("old", tenant="team-a")])
        old_id = (await redis.xrange(own))[0][0].decode()
        for start in range(0, 1000, 250):
            mixed = [
                envelope(f"k{i:04d}", tenant=("team-a", "team-b")[i % 2])
                for i in range(start, start + 250)
            ]
            await sink.write(mixed)
        oldest_id, oldest = (await redis.xrange(own, count=1))[0]
        assert oldest[b"prev"] != b"0-0"  # team-a's own entries were trimmed
        events: list[tuple[str, str]] = []
        async with httpx.AsyncClient(base_url=base, headers=bearer(TOKEN_A), timeout=10) as c:
            async for kind, _, data in sse(c, last_event_id=old_id):
                events.append((kind, data))
                if len(events) == 2:
                    break
        (kind, data), (first_kind, first) = events
        reset = orjson.loads(data)
        assert kind == "reset" and reset["reason"] == "trimmed"
        assert reset["resume_after"] == oldest[b"prev"].decode()  # team-a's own previous
        assert reset["oldest_retained_id"] == oldest_id.decode()
        assert first_kind == "result"
        assert orjson.loads(first)["tenant"] == "team-a"
        assert orjson.loads(first) == orjson.loads(oldest[b"envelope"])
    await redis.aclose()
