"""The results API (``/v1``) under a real server and Redis: tokens, GET, ``?wait``, tenants,
the OpenAPI document. Envelopes are published by the ``_results`` sink itself."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest
from redis import asyncio as redis_asyncio

from nopoll.client import Results, ResultsError
from nopoll.kinds import kind_names
from sinks.results import CHANNEL
from tests.receiver.helpers import TOKEN, TOKEN_A, bearer, envelope, with_tokens
from tests.servers import redis_via_proxy, running_api


async def test_every_v1_route_is_404_without_consumer_tokens(make_settings, redis_url):
    settings = make_settings(redis_url=redis_url, admin_tokens=["admin-token-0123456789"])
    async with running_api(settings, redis_url) as (base, _), httpx.AsyncClient() as client:
        for path in ("/v1/results/sim/resp_1", "/v1/results/stream", "/v1/results/sim/a/b"):
            r = await client.get(base + path, headers=bearer(TOKEN))
            assert r.status_code == 404, path
            assert r.json() == {"error": "not found"}
        r = await client.get(f"{base}/openapi.json")  # public, always there
        assert r.status_code == 200


async def test_tokens_are_checked(results_settings, redis_url):
    async with running_api(results_settings(), redis_url) as (base, _):
        async with httpx.AsyncClient(base_url=base) as client:
            for headers in ({}, bearer("wrong-token-0123456789"), {"authorization": TOKEN}):
                for path in ("/v1/results/sim/resp_1", "/v1/results/stream"):
                    r = await client.get(path, headers=headers)
                    assert r.status_code == 401, (path, headers)
                    assert r.json()["error"].startswith("Authorization: ")
                    assert r.headers["www-authenticate"].startswith("Bearer")
            r = await client.get("/v1/results/sim/resp_1", headers=bearer(TOKEN))
            assert r.status_code == 404 and r.json() == {"error": "not landed"}
        async with Results(base, "wrong-token-0123456789") as results:
            with pytest.raises(ResultsError) as caught:
                await results.get("sim", "resp_1")
            assert caught.value.status == 401


async def test_get_is_404_until_the_result_lands(results_settings, redis_url, published):
    async with running_api(results_settings(), redis_url) as (base, _):
        async with Results(base, TOKEN) as results:
            assert await results.get("sim", "resp_1") is None
            assert await results.get("sim", "batch_1/row 2?#") is None
            env, row = envelope("resp_1"), envelope("batch_1/row 2?#", kind="batch_row")
            await published.write([env, row])
            assert await results.get("sim", "resp_1") == env
            assert await results.get("sim", "batch_1/row 2?#") == row  # a key with a slash
            assert await results.get("other", "resp_1") is None
            assert await results.get("sim", "resp_1", tenant="team-b") is None
        async with httpx.AsyncClient(base_url=base, headers=bearer(TOKEN)) as client:
            r = await client.get("/v1/results/sim/resp_1")
            assert r.headers["content-type"] == "application/json"
            assert r.json() == env.to_dict()


@pytest.mark.parametrize("wait", ["0", "-1", "61", "abc", "nan", "inf", ""])
async def test_bad_wait_is_400_naming_it(results_settings, redis_url, wait):
    async with (
        running_api(results_settings(), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, headers=bearer(TOKEN)) as client,
    ):
        r = await client.get("/v1/results/sim/resp_1", params={"wait": wait})
    assert r.status_code == 400
    assert r.json()["error"].startswith("wait: ")


async def test_wait_answers_within_100_ms_of_landing(results_settings, redis_url, published):
    async with (
        running_api(results_settings(), redis_url) as (base, _),
        Results(base, TOKEN) as results,
    ):
        for i in range(5):
            key = f"resp_wait_{i}"
            waiting = asyncio.create_task(results.wait("sim", key, timeout=10))
            await asyncio.sleep(0.2)  # the request is held by now
            assert not waiting.done()
            await published.write([envelope(key)])
            landed = time.perf_counter()  # the script that published it has run
            got = await waiting
            delay = time.perf_counter() - landed
            assert got is not None and got.key == key
            assert delay < 0.1, f"answered {delay * 1000:.0f} ms after landing"
        # already there: answered at once
        started = time.perf_counter()
        assert (await results.wait("sim", "resp_wait_0", timeout=10)).key == "resp_wait_0"
        assert time.perf_counter() - started < 0.1


async def test_wait_times_out_with_404(results_settings, redis_url):
    async with (
        running_api(results_settings(), redis_url) as (base, _),
        Results(base, TOKEN) as results,
    ):
        started = time.monotonic()
        assert await results.wait("sim", "resp_never", timeout=0.5) is None
        assert 0.5 <= time.monotonic() - started < 2


async def test_a_client_wait_longer_than_the_servers_hold_asks_again(
    results_settings, redis_url, published
):
    """``Results.wait(timeout=...)`` past ``results.max_wait_s`` is not a 400: the client
    holds one request after another until the result lands or its timeout runs out."""
    settings = results_settings(results={"max_wait_s": 1})
    async with (
        running_api(settings, redis_url) as (base, _),
        Results(base, TOKEN, max_hold_s=1) as results,
    ):
        waiting = asyncio.create_task(results.wait("sim", "resp_late", timeout=5))
        await asyncio.sleep(2.2)  # two holds of 1 s have ended without it
        assert not waiting.done()
        await published.write([envelope("resp_late")])
        got = await asyncio.wait_for(waiting, 3)
        assert got is not None and got.key == "resp_late"
        started = time.monotonic()
        assert await results.wait("sim", "resp_never", timeout=2.5) is None
        assert 2.4 <= time.monotonic() - started < 4


async def test_many_waits_share_one_subscription_that_ends_with_them(
    results_settings, redis_url, published
):
    redis = redis_asyncio.Redis.from_url(redis_url)
    settings = results_settings(results={"max_held_per_token": 50})
    async with running_api(settings, redis_url) as (base, _):
        async with Results(base, TOKEN) as results:
            waits = [
                asyncio.create_task(results.wait("sim", f"resp_{i % 10}", timeout=10))
                for i in range(50)
            ]
            await asyncio.sleep(0.3)
            assert (await redis.pubsub_numsub(CHANNEL))[0][1] == 1
            await published.write([envelope(f"resp_{i}") for i in range(10)])
            got = await asyncio.gather(*waits)
            assert [g.key for g in got] == [f"resp_{i % 10}" for i in range(50)]
            for _ in range(100):
                if (await redis.pubsub_numsub(CHANNEL))[0][1] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await redis.pubsub_numsub(CHANNEL))[0][1] == 0
        # a client that goes away stops its wait (and the subscription) long before it ends
        async with httpx.AsyncClient(base_url=base, headers=bearer(TOKEN)) as client:
            gone = asyncio.create_task(client.get("/v1/results/sim/resp_x", params={"wait": 30}))
            await asyncio.sleep(0.3)
            assert (await redis.pubsub_numsub(CHANNEL))[0][1] == 1
            gone.cancel()
        for _ in range(100):
            if (await redis.pubsub_numsub(CHANNEL))[0][1] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await redis.pubsub_numsub(CHANNEL))[0][1] == 0
    await redis.aclose()


async def test_a_tenant_token_never_sees_another_tenants_result(
    results_settings, redis_url, published
):
    a, b = envelope("resp_a", tenant="team-a"), envelope("resp_b", tenant="team-b")
    async with running_api(results_settings(), redis_url) as (base, _):
        async with Results(base, TOKEN_A) as team_a, Results(base, TOKEN) as admin:
            b_waits = asyncio.create_task(
                team_a.wait("sim", "resp_b", timeout=0.6, tenant="team-b")
            )
            a_waits = asyncio.create_task(team_a.wait("sim", "resp_a", timeout=5))
            await asyncio.sleep(0.2)
            await published.write([b, a])
            assert await a_waits == a
            started = time.monotonic()
            assert await b_waits is None  # held as long as asked, then "not landed"
            assert time.monotonic() - started > 0.2
            assert await team_a.get("sim", "resp_a") == a
            assert await team_a.get("sim", "resp_a", tenant="team-a") == a
            assert await team_a.get("sim", "resp_b") is None
            assert await team_a.get("sim", "resp_b", tenant="team-b") is None
            assert await team_a.get("sim", "resp_b", tenant="default") is None
            # the unrestricted token picks the tenant (default: "default")
            assert await admin.get("sim", "resp_b") is None
            assert await admin.get("sim", "resp_b", tenant="team-b") == b
        async with httpx.AsyncClient(base_url=base, headers=bearer(TOKEN_A)) as client:
            r = await client.get("/v1/results/sim/resp_b", params={"tenant": "team-b"})
            assert (r.status_code, r.content) == (404, orjson.dumps({"error": "not landed"}))
            r = await client.get("/v1/results/stream", params={"tenant": "team-b"})
            assert r.status_code == 403 and r.json()["error"].startswith("tenant: ")


async def test_redis_down_is_503(make_settings, redis_url):
    async with (
        redis_via_proxy(redis_url) as (proxy, via_proxy),
        running_api(with_tokens(make_settings, via_proxy), via_proxy) as (base, _),
        httpx.AsyncClient(base_url=base, headers=bearer(TOKEN), timeout=10) as client,
    ):
        assert (await client.get("/v1/results/sim/resp_1")).status_code == 404
        await proxy.down()
        for params in ({}, {"wait": 1}):
            r = await client.get("/v1/results/sim/resp_1", params=params)
            assert r.status_code == 503, params
        assert (await client.get("/v1/results/stream")).status_code == 503
        await proxy.up()
        assert (await client.get("/v1/results/sim/resp_1")).status_code == 404


async def test_one_public_openapi_document_for_v1_and_admin(results_settings, redis_url):
    settings = results_settings(admin_tokens=["admin-token-0123456789"])
    async with running_api(settings, redis_url) as (base, _), httpx.AsyncClient() as client:
        r = await client.get(f"{base}/openapi.json")  # no token
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/results/{provider}/{key}", "/v1/results/stream", "/admin/v1/watches"} <= set(
        doc["paths"]
    )
    assert doc["paths"]["/v1/results/stream"]["get"]["security"] == [{"consumer": []}]
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "consumer"}
    envelope_schema = doc["components"]["schemas"]["Envelope"]
    assert envelope_schema["properties"]["kind"]["enum"] == list(kind_names())
    assert "tenant" in envelope_schema["required"]
    assert "secret" not in r.text.lower() and TOKEN not in r.text


async def test_a_wait_survives_a_redis_outage(make_settings, redis_url, published):
    """The subscription breaks while a request waits and the result lands meanwhile: once
    it is made again, the request gets the result."""
    async with (
        redis_via_proxy(redis_url) as (proxy, via_proxy),
        running_api(with_tokens(make_settings, via_proxy), via_proxy) as (base, _),
        Results(base, TOKEN) as results,
    ):
        waiting = asyncio.create_task(results.wait("sim", "resp_gap", timeout=20))
        await asyncio.sleep(0.3)
        await proxy.down()  # the API loses Redis, subscription included
        await published.write([envelope("resp_gap")])  # lands while nobody listens
        await asyncio.sleep(0.5)
        await proxy.up()
        got = await asyncio.wait_for(waiting, 15)
        assert got is not None and got.key == "resp_gap"
