"""Large envelopes on the results stream go by reference: a reader stalled before a 6 MB
envelope held about twice its size in the API (ten of them, 149 MiB). Above
``results.stream_inline_bytes`` the stream carries a small ``result-ref`` event naming
where the envelope is read (the results API's latest key), the Redis stream entry is as
small, and the Python client fetches the envelope by itself. Real server and Redis."""

from __future__ import annotations

import asyncio

import httpx
import orjson
from redis import asyncio as redis_asyncio

from nopoll.client import Results
from sinks.results import STREAM
from tests.receiver.helpers import TOKEN, bearer, envelope, sink_for
from tests.receiver.results.test_results_stream import sse
from tests.servers import running_api

BIG = 2_000_000  # characters of output text: well over the 256 KiB default


async def _raw_events(base: str, want: int) -> list[tuple[str, str, str]]:
    """(event, id, data) of a stream read from the start, until ``want`` came."""
    got: list[tuple[str, str, str]] = []
    async with httpx.AsyncClient(base_url=base, headers=bearer(TOKEN), timeout=10) as client:
        async for event in sse(client, last_event_id="0-0"):
            got.append(event)
            if len(got) == want:
                break
    return got


async def test_a_large_envelope_goes_by_reference(results_settings, redis_url):
    big = envelope("big", tenant="team-a", output_text="x" * BIG)
    async with sink_for(redis_url) as sink:
        await sink.write([envelope("small1"), big, envelope("small2")])
    redis = redis_asyncio.Redis.from_url(redis_url)
    try:
        entries = await redis.xrange(STREAM)
        carried = [f.get(b"envelope") or f[b"ref"] for _, f in entries]
        assert max(len(c) for c in carried) < 2_000  # not kept inline
    finally:
        await redis.aclose()
    async with running_api(results_settings(), redis_url) as (base, _):
        events = await asyncio.wait_for(_raw_events(base, 3), 10)
        kinds = [e[0] for e in events]
        assert kinds == ["result", "result-ref", "result"], kinds
        ref = orjson.loads(events[1][2])
        assert ref["key"] == "big" and ref["tenant"] == "team-a" and ref["bytes"] > BIG
        async with httpx.AsyncClient(base_url=base, headers=bearer(TOKEN)) as client:
            whole = await client.get(ref["ref"])
        assert whole.status_code == 200 and whole.json()["output_text"] == "x" * BIG
        # the Python client follows the reference by itself
        async with Results(base, TOKEN) as results:
            stream = results.stream(last_event_id="0-0")
            got = []
            async for env in stream:
                got.append(env)
                if len(got) == 3:
                    break
        assert [e.key for e in got] == ["small1", "big", "small2"]
        assert got[1].output_text == "x" * BIG
        assert stream.last_event_id == events[2][1]


async def test_a_large_envelope_never_passes_through_the_publish_script(redis_url):
    """Inside a Lua script Redis copies an argument twice while every other client waits
    (a 6 MB envelope held Redis 16 ms, and each callback behind it): the envelope goes in
    a plain SET ahead of the script, in the same trip, which Redis keeps as it read it."""
    big = envelope("big-set", tenant="team-a", output_text="y" * BIG)
    redis = redis_asyncio.Redis.from_url(redis_url)
    seen: list[str] = []

    async def read(monitor) -> None:
        while True:
            event = await monitor.next_command()
            seen.append(str(event["command"]))

    try:
        async with redis.monitor() as monitor:
            reader = asyncio.create_task(read(monitor))
            async with sink_for(redis_url) as sink:
                await sink.write([envelope("small-set"), big])
            for _ in range(100):  # bounded: until the script's own commands came by
                if any(line.startswith("XTRIM") for line in seen):
                    break
                await asyncio.sleep(0.02)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        scripts = [line for line in seen if line.startswith("EVALSHA")]
        sets = [line for line in seen if line.startswith("SET ") and "big-set" in line]
        assert len(scripts) == 1 and len(scripts[0]) < 10_000, [s[:300] for s in scripts]
        assert len(sets) == 1 and seen.index(sets[0]) < seen.index(scripts[0])
        key = sets[0].split(" ")[1]
        stored = orjson.loads(await redis.get(key))
        assert stored["output_text"] == "y" * BIG
        assert 0 < await redis.ttl(key) <= 120
    finally:
        await redis.aclose()
