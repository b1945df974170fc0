"""Where is my result? The journey of an id through real servers: the API (callbacks and
``GET /admin/v1/journey``), the worker, the provider simulator and Redis."""

from __future__ import annotations

import httpx
import pytest
from redis.asyncio import Redis

from receiver.journey.store import MAX_EVENTS, JourneyStore, journey_key
from tests.e2e.helpers import post, wait_for
from tests.servers import running_api, running_worker

pytestmark = pytest.mark.slow

ADMIN = "journey-admin-token-0123456789"
CONSUMER = "journey-consumer-token-012345"


@pytest.fixture
def settings_and_sim(make_settings, redis_url, provider_sim):
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    settings = make_settings(
        sim.base_url,
        redis_url=redis_url,
        admin_tokens=[ADMIN],
        consumer_tokens=[{"token": CONSUMER}],
        journey_ttl_s=3600,
    )
    return settings, sim


async def journey(base: str, path: str, **params: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.get(
            f"{base}/admin/v1/journey/{path}",
            params=params,
            headers={"authorization": f"Bearer {ADMIN}"},
        )


def steps(answer: dict) -> list[str]:
    return [e["step"] for e in answer["events"]]


async def test_a_failed_fetch_its_dead_letter_and_the_replay_that_lands_it(
    settings_and_sim, redis_url, signed_callback
):
    settings, sim = settings_and_sim
    sim.add_response("resp_j", text="found at last", fail_times=1, fail_status=404)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        body, headers = signed_callback("resp_j")
        assert (await post(base, body, headers)).status_code == 202
        assert (await post(base, body, headers)).status_code == 200  # the provider's retry

        async def dead_lettered() -> dict | None:
            answer = (await journey(base, "sim/resp_j")).json()
            # the letter and its event land together, but the events are read first
            return answer if answer.get("dead_letters") and "dead_letter" in steps(answer) else None

        answer = await wait_for(dead_lettered)
        assert (answer["provider"], answer["tenant"], answer["id"], answer["kind"]) == (
            "sim",
            "default",
            "resp_j",
            "response",
        )
        events = answer["events"]
        assert steps(answer) == ["callback", "callback", "fetch", "dead_letter"], events
        first, again, fetch, letter = events
        assert (first["step"], first["answer"], first["event"]) == (
            "callback",
            "202 queued",
            "response.completed",
        )
        assert first["webhook_id"] == headers["webhook-id"] and first["tenant"] == "default"
        assert (again["step"], again["answer"]) == ("callback", "200 duplicate")
        assert (fetch["step"], fetch["http"], fetch["try"]) == ("fetch", 404, 1)
        assert 'the provider said: "try again"' in fetch["error"]
        [kept] = answer["dead_letters"]
        assert (letter["step"], letter["letter"]) == ("dead_letter", kept["id"])
        assert answer["result"] is None and answer["watch"] is None

        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(
                f"{base}/admin/v1/deadletters/replay",
                json={"ids": [kept["id"]]},
                headers={"authorization": f"Bearer {ADMIN}"},
            )
            assert r.status_code == 200, r.text

        async def landed() -> dict | None:
            answer = (await journey(base, "sim/resp_j")).json()
            return answer if answer["result"] and "sink" in steps(answer) else None

        answer = await wait_for(landed)
        assert steps(answer)[-3:] == ["replay", "fetch", "sink"]
        assert answer["events"][-2]["status"] == "completed"
        assert answer["events"][-1]["sinks"] == ["_results", "files"]
        assert answer["dead_letters"] == []
        assert answer["result"] == "/v1/results/sim/resp_j"
        async with httpx.AsyncClient(timeout=10) as client:
            stored = await client.get(
                base + answer["result"], headers={"authorization": f"Bearer {CONSUMER}"}
            )
        assert stored.json()["output_text"] == "found at last"

        # by its webhook-id, the same journey
        by_hook = (await journey(base, f"sim/{headers['webhook-id']}")).json()
        assert (by_hook["id"], by_hook["webhook_id"]) == ("resp_j", headers["webhook-id"])
        assert by_hook["events"] == answer["events"]

        # another tenant's filter sees nothing of it; an unknown id is a 404 that says why
        settings_t = await journey(base, "sim/resp_j", tenant="acme")
        assert settings_t.status_code == 400  # acme is no tenant here: refused, not shown
        missing = await journey(base, "sim/resp_nobody")
        assert missing.status_code == 404 and "nothing known" in missing.json()["error"]
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(
                f"{base}/admin/v1/journey/sim/resp_j",
                headers={"authorization": f"Bearer {CONSUMER}"},
            )
        assert r.status_code == 401  # a consumer token is no admin token

    redis = Redis.from_url(redis_url)
    try:
        ttl = await redis.ttl(journey_key("sim", "resp_j"))
        assert 3500 < ttl <= 3600
        assert 3500 < await redis.ttl(f"nopoll:journey-hook:sim:{headers['webhook-id']}") <= 3600
    finally:
        await redis.aclose()


async def test_a_tenants_journey_is_its_own(
    make_settings, redis_url, provider_sim, signed_callback, webhook_secret
):
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    sim.add_response("resp_t")
    settings = make_settings(
        sim.base_url,
        redis_url=redis_url,
        admin_tokens=[ADMIN],
        tenant_keys=["tenant-key-0123456789abcdef0123456789"],
        tenants={"acme": {"providers": {"sim": {"api_key": "sk-acme-0123456789"}}}},
    )
    async with running_api(settings, redis_url) as (base, _):
        assert (await post(base, *signed_callback("resp_t"))).status_code == 202
        mine = await journey(base, "sim/resp_t")
        assert mine.status_code == 200 and steps(mine.json()) == ["callback"]
        theirs = await journey(base, "sim/resp_t", tenant="acme")
        assert theirs.status_code == 404


async def test_a_batch_row_key_finds_its_batchs_journey_and_the_rows_envelope(
    make_settings, redis_url, provider_sim, signed_callback
):
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    batch = sim.add_batch("openai", "batch_j", 250)
    settings = make_settings(
        sim.base_url,
        redis_url=redis_url,
        admin_tokens=[ADMIN],
        consumer_tokens=[{"token": CONSUMER}],
        batch={"chunk_size": 100},
    )
    row = f"batch_j/{batch.custom_id(7)}"
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        assert (
            await post(base, *signed_callback("batch_j", event_type="batch.completed"))
        ).status_code == 202

        async def written() -> dict | None:
            # the row's envelope is stored as its chunk lands; the sinks' events follow
            # once every chunk of the batch has gone to that sink
            answer = (await journey(base, f"sim/{row}")).json()
            done = answer.get("envelope") and steps(answer).count("sink") == 2
            return answer if done else None

        answer = await wait_for(written)
    assert (answer["id"], answer["row"], answer["kind"]) == ("batch_j", row, "batch")
    assert answer["envelope"]["key"] == row and answer["result"] == f"/v1/results/sim/{row}"
    # one event for the rows and one per sink, not one per row or chunk
    assert steps(answer) == ["callback", "fetch", "sink", "sink"]
    assert answer["events"][1]["rows"] == 250
    assert {e["sink"]: e["rows"] for e in answer["events"][2:]} == {"files": 250, "_results": 250}


async def test_a_trail_keeps_its_newest_events_only(redis_url):
    redis = Redis.from_url(redis_url)
    store = JourneyStore(redis, ttl_s=60)
    try:
        for n in range(MAX_EVENTS + 30):
            await store.record("sim", "resp_long", "fetch", kind="response", **{"try": n})
        events = await store.events("sim", "resp_long")
        assert len(events) == MAX_EVENTS == await redis.llen(journey_key("sim", "resp_long"))
        assert events[-1]["try"] == MAX_EVENTS + 29 and events[0]["try"] == 30
        assert 0 < await redis.ttl(journey_key("sim", "resp_long")) <= 60
        off = JourneyStore(redis, ttl_s=0)
        await off.record("sim", "resp_off", "fetch")
        assert await redis.exists(journey_key("sim", "resp_off")) == 0
    finally:
        await redis.aclose()
