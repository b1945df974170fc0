"""The ``_results`` sink against a real Redis, and how the worker adds it."""

from __future__ import annotations

import orjson
import pytest
from redis import asyncio as redis_asyncio

from nopoll.exceptions import ConfigError, SinkError
from receiver.metrics import Metrics
from receiver.redis import RedisConnector
from receiver.results.stream import parse_id
from receiver.worker.state import build_state
from sinks.results import (
    CHANNEL,
    LAST_ID,
    RESULTS_SINK,
    STREAM,
    latest_key,
)
from tests.receiver.helpers import envelope, sink_for
from tests.servers import free_port

TOKEN = "consumer-token-0123456789"


@pytest.fixture
async def redis(redis_url):
    client = redis_asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_write_sets_latest_appends_stream_and_publishes(redis_url, redis):
    pubsub = redis.pubsub()
    await pubsub.subscribe(CHANNEL)
    assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"
    envelopes = [envelope("resp_1"), envelope("b1/row-1", tenant="team-a", kind="batch_row")]
    async with sink_for(redis_url) as sink:
        await sink.write(envelopes)
        await sink.write([])  # nothing to do

    for env in envelopes:
        name = latest_key(env.tenant, env.provider, env.key)
        assert orjson.loads(await redis.get(name)) == env.to_dict()
        assert 0 < await redis.ttl(name) <= 120
    entries = await redis.xrange(STREAM)
    assert [orjson.loads(f[b"envelope"]) for _, f in entries] == [e.to_dict() for e in envelopes]
    (first_id, first), (second_id, second) = entries
    assert (second[b"tenant"], second[b"provider"], second[b"kind"], second[b"status"]) == (
        b"team-a",
        b"sim",
        b"batch_row",
        b"completed",
    )
    assert first[b"prev"] == b"0-0" and second[b"prev"] == first_id
    assert await redis.get(LAST_ID) == second_id
    heard = []
    for _ in range(2):
        message = await pubsub.get_message(timeout=2)
        heard.append(message["data"])
    assert heard == [latest_key(e.tenant, e.provider, e.key).encode() for e in envelopes]
    await pubsub.aclose()


async def test_a_rewrite_keeps_one_latest_and_appends_again(redis_url, redis):
    env = envelope("resp_again")
    async with sink_for(redis_url) as sink:
        await sink.write([env])
        await sink.write([env])  # a retried write
    assert await redis.xlen(STREAM) == 2  # at least once on the stream (documented)
    keys = [k async for k in redis.scan_iter(match=latest_key("default", "sim", "*"))]
    assert keys == [latest_key("default", "sim", "resp_again").encode()]


async def test_large_writes_are_split_and_the_stream_is_trimmed(redis_url, redis):
    async with sink_for(redis_url, stream_max_entries=100) as sink:
        await sink.write([envelope(f"resp_{i}") for i in range(1200)])
        entries = await redis.xrange(STREAM)
        assert 100 <= len(entries) < 400  # MAXLEN ~ trims whole nodes
        assert orjson.loads(entries[-1][1][b"envelope"])["key"] == "resp_1199"
        # the oldest retained entry names the newest trimmed one: no gap goes unnoticed
        oldest_prev = parse_id(entries[0][1][b"prev"])
        assert (0, 0) < oldest_prev < parse_id(entries[0][0])
        assert await redis.get(latest_key("default", "sim", "resp_0")) is not None


async def test_entries_older_than_the_retention_are_trimmed(redis_url, redis):
    for i in range(1, 151):  # fills radix nodes with entries from 1970
        await redis.xadd(STREAM, {"envelope": "{}"}, id=f"1-{i}")
    async with sink_for(redis_url, stream_retention_s=60) as sink:
        await sink.write([envelope("resp_now")])
    remaining = await redis.xrange(STREAM)
    assert len(remaining) < 100  # the first node, all old, went
    assert orjson.loads(remaining[-1][1][b"envelope"])["key"] == "resp_now"


async def test_redis_down_is_a_sink_error():
    async with sink_for(f"redis://127.0.0.1:{free_port()}/0", timeout_s=2) as sink:
        with pytest.raises(SinkError) as caught:
            await sink.write([envelope("resp_1")])
    assert caught.value.sink == RESULTS_SINK


async def test_the_worker_sends_every_envelope_to_it_whatever_the_routes(
    make_settings, redis_url, tmp_path
):
    routes = [{"match": {"provider": "elsewhere"}, "sinks": ["files"]}]
    settings = make_settings(redis_url=redis_url, routes=routes, consumer_tokens=[{"token": TOKEN}])
    state = build_state(settings, RedisConnector.from_url(redis_url), Metrics())
    try:
        assert set(state.fanout.sinks) == {"files", RESULTS_SINK}
        shares = state.fanout.route([envelope("resp_1"), envelope("x", provider="elsewhere")])
        assert {n: [e.key for e in s] for n, s in shares.items()} == {
            RESULTS_SINK: ["resp_1", "x"],
            "files": ["x"],
        }
        unrouted = state.metrics.unrouted.labels("sim")._value.get()
        assert unrouted == 1  # still counted: no configured sink took it
    finally:
        await state.aclose()


async def test_without_consumer_tokens_there_is_no_results_sink(make_settings, redis_url):
    state = build_state(
        make_settings(redis_url=redis_url), RedisConnector.from_url(redis_url), Metrics()
    )
    try:
        assert RESULTS_SINK not in state.fanout.sinks
        assert RESULTS_SINK not in state.fanout.route([envelope("resp_1")])
    finally:
        await state.aclose()


def test_a_configured_sink_cannot_take_its_name(make_settings, redis_url, tmp_path):
    sinks = {RESULTS_SINK: {"type": "jsonl", "dir": str(tmp_path / "r")}}
    settings = make_settings(redis_url=redis_url, sinks=sinks, consumer_tokens=[{"token": TOKEN}])
    with pytest.raises(ConfigError, match="reserved"):
        build_state(settings, RedisConnector.from_url(redis_url), Metrics())
