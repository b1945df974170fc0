"""Consumers end to end: signed callback → worker → provider → the results API (``/v1``),
read back with :mod:`nopoll.client` while the other sinks get their rows too."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from redis import asyncio as redis_asyncio

from nopoll.client import Results
from nopoll.envelope import now_rfc3339
from receiver.queue.enqueue import FETCH_RESPONSE, QueuedJob, put_job, response_job_id
from sinks.results import STREAM
from tests.e2e.helpers import jsonl_rows, pg_rows, post, wait_for, worker_started
from tests.servers import running_api, running_worker

TOKEN = "consumer-token-all-0123456789"
TOKEN_A = "consumer-token-team-a-0123456789"
KEY = "sk-test-not-a-real-key"


@pytest.fixture
def consumer_stack(make_settings, redis_url, provider_sim, pg_url, pg_table, tmp_path):
    """Factory for (settings, sim): Postgres + JSONL sinks, consumer tokens, two tenants."""

    def make(**overrides):
        sim = provider_sim(api_key=[KEY, *(f"{KEY}-{t}" for t in ("team-a", "team-b"))])
        sinks = {
            "warehouse": {"type": "sql", "url": pg_url, "table": pg_table},
            "files": {"type": "jsonl", "dir": str(tmp_path / "results")},
        }
        raw = {
            "consumer_tokens": [{"token": TOKEN}, {"token": TOKEN_A, "tenant": "team-a"}],
            "tenants": {
                t: {"providers": {"sim": {"api_key": f"{KEY}-{t}"}}} for t in ("team-a", "team-b")
            },
            "tenant_keys": ["k" * 40],
            "batch": {"chunk_size": 20},
            **overrides,
        }
        return make_settings(sim.base_url, redis_url=redis_url, sinks=sinks, **raw), sim

    return make


async def collect(stream, count: int, keys: list[str]) -> None:
    async for env in stream:
        keys.append(env.key)
        if len(keys) == count:
            return


async def test_a_callback_lands_for_get_wait_and_stream(
    consumer_stack, redis_url, signed_callback, pg_url, pg_table
):
    # the only route sends nothing anywhere: the results API gets every envelope anyway
    settings, sim = consumer_stack(routes=[{"match": {"provider": "nobody"}, "sinks": ["files"]}])
    sim.add_response("resp_c1", text="hello consumers")
    async with (
        running_api(settings, redis_url) as (base, _),
        running_worker(settings, redis_url),
        Results(base, TOKEN) as results,
    ):
        await wait_for(lambda: worker_started(redis_url))
        assert await results.get("sim", "resp_c1") is None
        stream = results.stream(provider="sim", last_event_id="0-0")
        streamed: list[str] = []
        reader = asyncio.create_task(collect(stream, 1, streamed))
        waiting = asyncio.create_task(results.wait("sim", "resp_c1", timeout=20))
        await asyncio.sleep(0.2)
        body, headers = signed_callback("resp_c1")
        assert (await post(base, body, headers)).status_code == 202
        env = await waiting
        assert env is not None
        assert (env.provider, env.key, env.kind, env.status, env.tenant) == (
            "sim",
            "resp_c1",
            "response",
            "completed",
            "default",
        )
        assert env.output_text == "hello consumers" and env.event_id == headers["webhook-id"]
        assert await results.get("sim", "resp_c1") == env
        await asyncio.wait_for(reader, 10)
        assert streamed == ["resp_c1"] and stream.last_event_id is not None
    assert await pg_rows(pg_url, pg_table) == []  # routed nowhere


async def test_batch_rows_stream_and_each_row_is_readable(
    consumer_stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, sim = consumer_stack()
    batch = sim.add_batch("openai", "batch_c1", 50)
    async with (
        running_api(settings, redis_url) as (base, _),
        running_worker(settings, redis_url),
        Results(base, TOKEN) as results,
    ):
        await wait_for(lambda: worker_started(redis_url))
        keys: list[str] = []
        reader = asyncio.create_task(collect(results.stream(last_event_id="0-0"), 51, keys))
        r = await post(base, *signed_callback(batch.batch_id, event_type="batch.completed"))
        assert r.status_code == 202
        await asyncio.wait_for(reader, 30)
        assert keys[-1] == "batch_c1"  # the summary after its rows
        rows = [k for k in keys if k != "batch_c1"]
        assert len(rows) == len(set(rows)) == 50
        row = await results.get("sim", rows[7])  # a key with a slash in it
        assert row is not None and row.kind == "batch_row" and row.batch_id == "batch_c1"
    assert len(await wait_for(lambda: pg_rows(pg_url, pg_table))) >= 1


async def test_tenant_results_stay_with_their_tenant(consumer_stack, redis_url, tmp_path):
    settings, sim = consumer_stack()
    for rid in ("resp_ta", "resp_tb"):
        sim.add_response(rid, text=rid)
    async with (
        redis_asyncio.Redis.from_url(redis_url) as redis,
        running_api(settings, redis_url) as (base, _),
        running_worker(settings, redis_url),
        Results(base, TOKEN_A) as team_a,
        Results(base, TOKEN) as everyone,
    ):
        await wait_for(lambda: worker_started(redis_url))
        seen_by_a: list[str] = []
        reader = asyncio.create_task(collect(team_a.stream(last_event_id="0-0"), 1, seen_by_a))
        b_wait = asyncio.create_task(team_a.wait("sim", "resp_tb", timeout=3, tenant="team-b"))
        # jobs as a tenant endpoint queues them (the fetch carries the tenant)
        for rid, tenant in (("resp_tb", "team-b"), ("resp_ta", "team-a")):
            kwargs = {"provider": "sim", "response_id": rid, "received_at": now_rfc3339()}
            job = QueuedJob(
                FETCH_RESPONSE, response_job_id("sim", rid), {**kwargs, "tenant": tenant}
            )
            assert await put_job(redis, job, expiry_ms=60_000)
        env_a = await team_a.wait("sim", "resp_ta", timeout=20)
        assert env_a is not None and env_a.tenant == "team-a"
        await asyncio.wait_for(reader, 10)
        assert seen_by_a == ["resp_ta"]
        env_b = await everyone.wait("sim", "resp_tb", timeout=20, tenant="team-b")
        assert env_b is not None and env_b.tenant == "team-b"
        assert await b_wait is None  # team-a's token: held, then "not landed"
        assert await team_a.get("sim", "resp_tb", tenant="team-b") is None
        assert await team_a.get("sim", "resp_tb") is None
    await redis.aclose()
    files = jsonl_rows(tmp_path / "results")
    assert {(f["key"], f["tenant"]) for f in files} == {
        ("resp_ta", "team-a"),
        ("resp_tb", "team-b"),
    }


async def test_without_consumer_tokens_nothing_is_published(
    make_settings, redis_url, provider_sim, signed_callback, tmp_path
):
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    sim.add_response("resp_plain")
    settings = make_settings(sim.base_url, redis_url=redis_url)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        assert (await post(base, *signed_callback("resp_plain"))).status_code == 202
        await wait_for(lambda: asyncio.to_thread(jsonl_rows, tmp_path / "results"))
        async with httpx.AsyncClient(base_url=base) as client:
            headers = {"authorization": f"Bearer {TOKEN}"}
            r = await client.get("/v1/results/sim/resp_plain", headers=headers)
            assert r.status_code == 404 and r.json() == {"error": "not found"}
    async with redis_asyncio.Redis.from_url(redis_url) as redis:
        assert not await redis.exists(STREAM)
