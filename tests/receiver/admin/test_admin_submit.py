"""POST /admin/v1/submit under a real uvicorn server, Redis and the provider simulator:
bodies created once (a repeat submits nothing new), rejections with the provider's
reason, one batch, and a 4xx naming the field for bad input."""

from __future__ import annotations

import httpx
import pytest
from redis.asyncio import Redis

from receiver.watches.store import WatchStore
from tests.servers import running_api

TOKEN = "admin-token-0123456789abcdef"


@pytest.fixture
async def stack(make_settings, redis_url, provider_sim):
    async def make(**sim_settings):
        sim = provider_sim(**sim_settings)
        settings = make_settings(sim.base_url, redis_url=redis_url, admin_tokens=[TOKEN])
        dialect = sim_settings.get("dialect", "openai")
        provider = settings.providers["sim"].model_copy(update={"dialect": dialect})
        return sim, settings.model_copy(update={"providers": {"sim": provider}})

    return make


def _bodies(n):
    return [{"model": "m-1", "input": f"q {i}", "custom_id": f"c{i}"} for i in range(n)]


async def test_bodies_are_created_once_watched_and_rejections_say_why(stack, redis_url):
    sim, settings = await stack()
    bodies = _bodies(20)
    bodies[5]["model"] = "reject-me"
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with (
        running_api(settings, redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as client,
    ):
        first = await client.post("/admin/v1/submit", json={"provider": "sim", "requests": bodies})
        assert first.status_code == 200, first.text
        answer = first.json()
        assert (answer["submitted"], answer["already"], len(answer["ids"])) == (19, 0, 19)
        assert answer["rejected"] == [
            {"line": 6, "custom_id": "c5", "status": 400, "error": "model reject-me does not exist"}
        ]
        again = await client.post("/admin/v1/submit", json={"provider": "sim", "requests": bodies})
        assert (again.json()["submitted"], again.json()["already"]) == (0, 19)
    assert sim.creations("responses") == 19
    redis = Redis.from_url(redis_url)
    try:
        watch = await WatchStore(redis).get("sim", "response", answer["ids"][0])
    finally:
        await redis.aclose()
    assert watch is not None and watch.state == "pending"
    # the provider has webhook secrets: callbacks do the work, polls are the safety net
    assert watch.expect_callback


async def test_one_batch_is_created_once(stack, redis_url):
    sim, settings = await stack(dialect="sference")
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": "m", "input": "x"},
        }
        for i in range(10)
    ]
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with (
        running_api(settings, redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as client,
    ):
        first = await client.post("/admin/v1/submit", json={"provider": "sim", "batch": lines})
        assert first.status_code == 200, first.text
        assert first.json()["batch_id"] and first.json()["rows"] == 10
        again = await client.post("/admin/v1/submit", json={"provider": "sim", "batch": lines})
        assert again.json()["already"] is True
        assert again.json()["batch_id"] == first.json()["batch_id"]
        spec = (await client.get("/admin/v1/openapi.json")).json()
    assert "/admin/v1/submit" in spec["paths"]
    assert sim.creations("batches") == 1


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"provider": "sim"}, "give exactly one of requests and batch"),
        (
            {"provider": "sim", "requests": [], "batch": []},
            "give exactly one of requests and batch",
        ),
        ({"provider": "sim", "requests": []}, "requests or batch: must not be empty"),
        ({"provider": "nope", "requests": [{}]}, "provider: unknown provider 'nope'"),
        ({"provider": "sim", "requests": [1]}, "requests.0:"),
        ({"provider": "sim", "requests": [{}], "x": 1}, "x: unknown field"),
    ],
)
async def test_bad_input_is_400_naming_the_field(stack, redis_url, body, error):
    sim, settings = await stack()
    async with (
        running_api(settings, redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        r = await client.post(
            "/admin/v1/submit", json=body, headers={"authorization": f"Bearer {TOKEN}"}
        )
        denied = await client.post("/admin/v1/submit", json=body)
    assert r.status_code == 400 and error in r.json()["error"], r.text
    assert denied.status_code == 401
    assert sim.request_count("/v1/") == 0


async def test_an_anthropic_provider_takes_a_batch_and_refuses_single_requests(
    make_settings, provider_sim, redis_url
):
    """Anthropic's Message Batches API has no single background requests: ``requests`` is
    refused before anything is sent (as ``nopoll submit`` without ``--batch`` is), and
    ``batch`` lines become one Message Batch, watched."""
    key = "sk-test-not-a-real-key"
    sim = provider_sim(api_key=key)
    settings = make_settings(sim.host_url, redis_url=redis_url, admin_tokens=[TOKEN])
    provider = settings.providers["sim"].model_copy(
        update={"dialect": "anthropic", "webhook_secrets": []}
    )
    settings = settings.model_copy(update={"providers": {"sim": provider}})
    params = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    lines = [{"custom_id": f"c{i}", "params": params} for i in range(5)]
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with (
        running_api(settings, redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as client,
    ):
        single = await client.post(
            "/admin/v1/submit", json={"provider": "sim", "requests": _bodies(2)}
        )
        assert sim.request_count() == 0  # nothing was sent
        batch = await client.post("/admin/v1/submit", json={"provider": "sim", "batch": lines})
    assert single.status_code == 400, single.text
    assert "batches only" in single.json()["error"] and "batch" in single.json()["error"]
    assert batch.status_code == 200, batch.text
    assert batch.json()["batch_id"] == sim.anthropic.created[0] and batch.json()["rows"] == 5
    redis = Redis.from_url(redis_url)
    try:
        watch = await WatchStore(redis).get("sim", "batch", batch.json()["batch_id"])
    finally:
        await redis.aclose()
    assert watch is not None and not watch.expect_callback
