"""``GET /v1/results/stream`` under a real server and Redis: filters, tenants, resuming with
Last-Event-ID (no gap, no duplicate), trimmed history (``reset``), slow subscribers."""

from __future__ import annotations

import asyncio
import gc

import httpx
import orjson
import pytest
from redis import asyncio as redis_asyncio

import receiver.results.stream as results_stream
from nopoll.client import Results, ResultsError, StreamReset
from receiver.results.stream import parse_id
from sinks.results import STREAM
from tests.receiver.helpers import TOKEN, TOKEN_A, bearer, envelope, sink_for, with_tokens
from tests.servers import TcpProxy, redis_via_proxy, running_api


async def sse(client: httpx.AsyncClient, *, last_event_id: str | None = None, **params):
    """(event, id, data) of one connection to the stream, as the server sends them."""
    headers = {"last-event-id": last_event_id} if last_event_id else {}
    async with client.stream("GET", "/v1/results/stream", params=params, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        async for line in r.aiter_lines():
            if not line:
                if "data" in fields:
                    yield fields.get("event", "message"), fields.get("id"), fields["data"]
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value


def difference(got: list[str], want: list[str]) -> str | None:
    """None when equal, else a short description (pytest's diff of long lists is slow)."""
    if got == want:
        return None
    missing = [k for k in want if k not in set(got)]
    twice = sorted({k for k in got if got.count(k) > 1})
    first = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), None)
    return (
        f"got {len(got)}, want {len(want)}; missing {missing[:5]}; twice {twice[:5]}; "
        f"first difference at {first}: {got[first : first + 3] if first is not None else ''}"
    )


async def collect(stream, count: int, keys: list[str]) -> None:
    async for env in stream:
        keys.append(env.key)
        if len(keys) == count:
            return


async def until_subscribed(n: int, limit_s: float = 5.0) -> None:
    """Wait until the server's stream reader has ``n`` subscribers (it is in-process)."""
    for _ in range(int(limit_s / 0.01)):
        if any(hub.subscribers >= n for hub in _hubs()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} subscribers did not attach")


def _hubs() -> list[results_stream.StreamHub]:
    """The stream readers of the in-process servers."""
    return [o for o in gc.get_objects() if isinstance(o, results_stream.StreamHub)]


async def test_three_subscribers_each_get_exactly_their_envelopes(
    results_settings, redis_url, published
):
    mix = [
        envelope(
            f"k{i}",
            tenant=("team-a", "team-b", "default")[i % 3],
            provider=("sim", "other")[i % 2],
            kind=("response", "batch_row")[i % 4 // 2],
            status=("completed", "failed", "completed", "expired", "cancelled")[i % 5],
        )
        for i in range(90)
    ]
    # matches all three filters: each subscriber stops at it
    last = envelope("last", tenant="team-a", provider="other", kind="batch_row", status="failed")
    filters = {
        "team-a": {"tenant": "team-a"},
        "other rows": {"provider": "other", "kind": "batch_row"},
        "failed": {"status": "failed,expired"},
    }
    wanted = {
        "team-a": [e.key for e in mix if e.tenant == "team-a"],
        "other rows": [e.key for e in mix if e.provider == "other" and e.kind == "batch_row"],
        "failed": [e.key for e in mix if e.status in ("failed", "expired")],
    }
    async with (
        running_api(results_settings(), redis_url) as (base, _),
        Results(base, TOKEN) as results,
    ):
        got: dict[str, list[str]] = {name: [] for name in filters}
        tasks = [
            asyncio.create_task(collect(results.stream(**params), len(wanted[name]) + 1, got[name]))
            for name, params in filters.items()
        ]
        await until_subscribed(3)
        for i in range(0, 90, 7):
            await published.write(mix[i : i + 7])
        await published.write([last])
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    for name in filters:
        assert difference(got[name], [*wanted[name], "last"]) is None, name


async def test_a_tenant_token_streams_its_tenant_only(results_settings, redis_url, published):
    async with (
        running_api(results_settings(), redis_url) as (base, _),
        Results(base, TOKEN_A) as team_a,
    ):
        keys: list[str] = []
        task = asyncio.create_task(collect(team_a.stream(), 5, keys))
        await until_subscribed(1)
        for i in range(10):
            tenant = "team-a" if i % 2 else ("team-b", "default")[i % 4 // 2]
            await published.write([envelope(f"k{i}", tenant=tenant)])
        await asyncio.wait_for(task, 10)
        assert keys == ["k1", "k3", "k5", "k7", "k9"]
        with pytest.raises(ResultsError) as caught:
            async for _ in team_a.stream(tenant="team-b"):
                pass
        assert caught.value.status == 403


@pytest.mark.parametrize(
    ("params", "field"),
    [({"kind": "rows"}, "kind"), ({"status": "done"}, "status"), ({"tenant": "a:b"}, "tenant")],
)
async def test_bad_filters_and_ids_are_400(results_settings, redis_url, params, field):
    async with (
        running_api(results_settings(), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, headers=bearer(TOKEN)) as client,
    ):
        r = await client.get("/v1/results/stream", params=params)
        assert r.status_code == 400 and r.json()["error"].startswith(f"{field}: ")
        r = await client.get("/v1/results/stream", headers={"last-event-id": "yesterday"})
        assert r.status_code == 400 and r.json()["error"].startswith("last_event_id: ")


async def test_reconnecting_with_last_event_id_leaves_no_gap_and_no_duplicate(
    results_settings, redis_url, published
):
    total = 400

    async def produce() -> None:
        for i in range(total):
            await published.write([envelope(f"k{i:04d}")])
            await asyncio.sleep(0.002)

    async with (
        running_api(results_settings(), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, headers=bearer(TOKEN), timeout=10) as client,
    ):
        # from the start: the first entry's predecessor is 0-0
        keys: list[str] = []
        last_id: str | None = "0-0"
        producer = asyncio.create_task(produce())
        connections = 0
        for _ in range(100):  # bounded: reconnect after every 37 events
            connections += 1
            async for event, event_id, data in sse(client, last_event_id=last_id):
                assert event == "result"
                keys.append(orjson.loads(data)["key"])
                last_id = event_id
                if len(keys) % 37 == 0 or len(keys) == total:
                    break
            if len(keys) == total:
                break
        await producer
    assert connections > 5  # it did reconnect while results kept landing
    assert difference(keys, [f"k{i:04d}" for i in range(total)]) is None


async def test_the_client_reconnects_by_itself(results_settings, redis_url, published):
    """The API behind a proxy that cuts every connection: the client resumes each time."""
    async with running_api(results_settings(), redis_url) as (base, _):
        proxy = TcpProxy("127.0.0.1", int(base.rsplit(":", 1)[1]))
        await proxy.up()
        try:
            async with Results(f"http://127.0.0.1:{proxy.port}", TOKEN) as results:
                stream = results.stream(last_event_id="0-0")
                keys: list[str] = []
                task = asyncio.create_task(collect(stream, 60, keys))
                for i in range(60):
                    await published.write([envelope(f"k{i:03d}")])
                    if i % 20 == 10:
                        await asyncio.sleep(0.2)
                        await proxy.down()  # cuts the stream's connection
                        await proxy.up()
                await asyncio.wait_for(task, 30)
        finally:
            await proxy.down()
    assert difference(keys, [f"k{i:03d}" for i in range(60)]) is None


async def test_trimmed_history_sends_reset_first(results_settings, redis_url):
    redis = redis_asyncio.Redis.from_url(redis_url)
    async with (
        sink_for(redis_url, stream_max_entries=100) as sink,
        running_api(results_settings(), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, headers=bearer(TOKEN), timeout=10) as client,
    ):
        await sink.write([envelope("old")])
        old_id = (await redis.xrange(STREAM))[0][0].decode()
        await sink.write([envelope(f"k{i:04d}") for i in range(1000)])
        oldest_id, oldest = (await redis.xrange(STREAM, count=1))[0]
        assert parse_id(oldest_id) > parse_id(old_id)
        events = []
        async for event in sse(client, last_event_id=old_id):
            events.append(event)
            if len(events) == 3:
                break
        (kind, event_id, data), first, second = events
        assert (kind, event_id) == ("reset", None)
        reset = orjson.loads(data)
        assert reset["reason"] == "trimmed" and reset["last_event_id"] == old_id
        assert reset["oldest_retained_id"] == oldest_id.decode()
        assert reset["resume_after"] == oldest[b"prev"].decode()
        assert first[:2] == ("result", oldest_id.decode())
        assert orjson.loads(first[2]) == orjson.loads(oldest[b"envelope"])
        assert parse_id(first[1]) < parse_id(second[1])

        # the client raises StreamReset, then goes on from the oldest retained entry
        async with Results(base, TOKEN) as results:
            stream = results.stream(last_event_id=old_id)
            with pytest.raises(StreamReset) as caught:
                async for _ in stream:
                    pass
            assert caught.value.oldest_retained_id == oldest_id.decode()
            assert stream.last_event_id == reset["resume_after"]
            async for env in stream:  # no second reset: resume_after is exact
                assert env.key == orjson.loads(oldest[b"envelope"])["key"]
                break

        # resuming from a retained entry, or from the newest trimmed one: no reset
        for after in (oldest_id.decode(), reset["resume_after"]):
            async for event in sse(client, last_event_id=after):
                assert event[0] == "result"
                break
        # an id newer than anything the stream had (Redis lost its data): reset too
        async for event in sse(client, last_event_id="99999999999999-0"):
            assert event[0] == "reset" and orjson.loads(event[2])["reason"] == "unknown_id"
            break
    await redis.aclose()


async def test_a_slow_subscriber_catches_up_from_redis(
    results_settings, redis_url, published, monkeypatch
):
    monkeypatch.setattr(results_stream, "MAILBOX_LIMIT", 5)  # the server is in-process
    async with (
        running_api(results_settings(), redis_url) as (base, _),
        Results(base, TOKEN) as results,
    ):
        keys: list[str] = []
        task = asyncio.create_task(collect(results.stream(), 600, keys))
        await until_subscribed(1)
        for i in range(0, 600, 200):  # each write reaches the reader as one batch
            await published.write([envelope(f"k{j:03d}") for j in range(i, i + 200)])
        await asyncio.wait_for(task, 20)
    assert difference(keys, [f"k{i:03d}" for i in range(600)]) is None


async def test_without_last_event_id_only_new_entries_come(results_settings, redis_url, published):
    await published.write([envelope("before")])
    async with (
        running_api(results_settings(), redis_url) as (base, _),
        Results(base, TOKEN) as results,
    ):
        keys: list[str] = []
        task = asyncio.create_task(collect(results.stream(), 1, keys))
        await until_subscribed(1)
        await published.write([envelope("after")])
        await asyncio.wait_for(task, 10)
        assert keys == ["after"]
        # once the last subscriber left, the reader stops
        for _ in range(200):
            if not any(h.subscribers for h in _hubs()):
                break
            await asyncio.sleep(0.01)
        assert not any(h.subscribers for h in _hubs())


async def test_a_client_that_stops_reading_is_disconnected(
    results_settings, redis_url, published, monkeypatch
):
    import socket

    import receiver.results.routes as results_api

    monkeypatch.setattr(results_api, "_SEND_TIMEOUT_S", 1.0)  # the server is in-process
    async with running_api(results_settings(), redis_url) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        request = (
            f"GET /v1/results/stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
        )
        sock.sendall(request.encode())
        await until_subscribed(1)
        big = "x" * 20_000
        for i in range(0, 400, 50):  # far more than the socket buffers hold
            await published.write([envelope(f"k{j}", output_text=big) for j in range(i, i + 50)])
        for _ in range(500):
            if not any(h.subscribers for h in _hubs()):
                break
            await asyncio.sleep(0.02)
        assert not any(h.subscribers for h in _hubs())  # dropped, and detached
        sock.close()


async def test_the_stream_goes_on_after_a_redis_outage(make_settings, redis_url, published):
    async with (
        redis_via_proxy(redis_url) as (proxy, via_proxy),
        running_api(with_tokens(make_settings, via_proxy), via_proxy) as (base, _),
        Results(base, TOKEN) as results,
    ):
        keys: list[str] = []
        task = asyncio.create_task(collect(results.stream(last_event_id="0-0"), 30, keys))
        await until_subscribed(1)
        await published.write([envelope(f"k{i:02d}") for i in range(10)])
        await asyncio.sleep(0.3)
        await proxy.down()
        await published.write([envelope(f"k{i:02d}") for i in range(10, 20)])
        await asyncio.sleep(0.5)
        await proxy.up()
        await published.write([envelope(f"k{i:02d}") for i in range(20, 30)])
        await asyncio.wait_for(task, 20)
        assert difference(keys, [f"k{i:02d}" for i in range(30)]) is None
