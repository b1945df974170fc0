"""Rate limits on the webhook route under a real server and Redis: per client address
(two loopback addresses) and per provider; off by default."""

from __future__ import annotations

import asyncio
import time

import httpx
from redis.asyncio import Redis

from receiver.queue.enqueue import JOBS_QUEUE
from receiver.webhooks.tenants import endpoint_path, endpoint_token
from tests.servers import running_api


def _client(base: str, address: str) -> httpx.AsyncClient:
    """An HTTP client whose connections come from ``address`` (a loopback address)."""
    return httpx.AsyncClient(
        base_url=base, transport=httpx.AsyncHTTPTransport(local_address=address), timeout=10
    )


async def _at_the_start_of_a_second() -> None:
    """Wait until just after a whole second. The limiter's windows are whole seconds and the
    last one's count weighs less as the next one goes by, so a burst that crosses into the
    next second gets one request more through than the limit says."""
    await asyncio.sleep(1.02 - time.time() % 1)


def _with_team_a(make_settings, redis_url: str, webhook_secret: str, **api: int):
    """Settings with ``api`` limits and tenant ``team-a`` (its own key, the same secret)."""
    team = {"providers": {"sim": {"api_key": "sk-team-a", "webhook_secrets": [webhook_secret]}}}
    return make_settings(
        redis_url=redis_url,
        api=api,
        tenant_keys=["tenant-key-" + "k" * 32],
        tenants={"team-a": team},
    )


async def _send(client: httpx.AsyncClient, signed_callback, n: int, prefix: str) -> list:
    answers = []
    for i in range(n):
        body, headers = signed_callback(f"{prefix}_{i}")
        answers.append(await client.post("/webhooks/sim", content=body, headers=headers))
    return answers


async def test_an_address_over_its_limit_gets_429_and_another_address_is_untouched(
    make_settings, redis_url, signed_callback
):
    settings = make_settings(redis_url=redis_url, api={"client_rps": 5})
    async with running_api(settings, redis_url) as (base, metrics):
        async with _client(base, "127.0.0.2") as noisy, _client(base, "127.0.0.3") as calm:
            await _at_the_start_of_a_second()
            flood = await _send(noisy, signed_callback, 12, "resp_noisy")
            fine = await _send(calm, signed_callback, 4, "resp_calm")
        codes = [r.status_code for r in flood]
        assert codes[:5] == [202] * 5 and set(codes[5:]) == {429}, codes
        refused = flood[-1]
        assert "at most 5 a second" in refused.json()["error"]
        assert 1 <= int(refused.headers["retry-after"]) <= 2
        assert refused.headers["connection"] == "close"
        assert [r.status_code for r in fine] == [202] * 4
        text = metrics.render().decode()
        assert 'nopoll_callbacks_total{outcome="rate_limited",provider="sim"} 7.0' in text
    redis = Redis.from_url(redis_url)
    try:
        assert await redis.zcard(JOBS_QUEUE) == 9  # only the accepted ones were queued
    finally:
        await redis.aclose()


async def test_a_flood_of_bad_signatures_is_refused_before_it_is_verified(
    make_settings, redis_url, signed_callback
):
    settings = make_settings(redis_url=redis_url, api={"client_rps": 3})
    async with running_api(settings, redis_url) as (base, metrics), _client(base, "127.0.0.4") as c:
        body, headers = signed_callback("resp_x")
        headers["webhook-signature"] = "v1,AAAA"
        await _at_the_start_of_a_second()
        codes = [
            (await c.post("/webhooks/sim", content=body, headers=headers)).status_code
            for _ in range(10)
        ]
        assert codes == [401] * 3 + [429] * 7
        verified = metrics.verify_seconds.collect()[0].samples
        count = next(s.value for s in verified if s.name.endswith("_count"))
        assert count == 3  # the refused ones cost no HMAC


async def test_a_provider_limit_counts_every_address(make_settings, redis_url, signed_callback):
    settings = make_settings(redis_url=redis_url, api={"provider_rps": 4})
    async with running_api(settings, redis_url) as (base, _):
        async with _client(base, "127.0.0.5") as a, _client(base, "127.0.0.6") as b:
            await _at_the_start_of_a_second()
            answers = await _send(a, signed_callback, 3, "resp_a")
            answers += await _send(b, signed_callback, 3, "resp_b")
        assert [r.status_code for r in answers] == [202] * 4 + [429] * 2
        assert "too many requests from this provider" in answers[-1].json()["error"]


async def test_without_limits_nothing_is_refused(make_settings, redis_url, signed_callback):
    async with running_api(make_settings(redis_url=redis_url), redis_url) as (base, _):
        async with _client(base, "127.0.0.7") as c:
            answers = await _send(c, signed_callback, 60, "resp_free")
        assert {r.status_code for r in answers} == {202}


async def test_forged_tenant_tokens_are_counted_against_their_address_first(
    make_settings, redis_url, signed_callback, webhook_secret
):
    """The per-address limit comes before the token is checked: a flood of forged tenant
    endpoints gets 429, and a genuine tenant's callback is counted once, not twice."""
    settings = _with_team_a(make_settings, redis_url, webhook_secret, client_rps=5)
    genuine = endpoint_path(endpoint_token(settings, "team-a", "sim"))
    async with running_api(settings, redis_url) as (base, metrics):
        async with _client(base, "127.0.0.8") as forger, _client(base, "127.0.0.9") as team_a:
            codes = [
                (await forger.post(f"/webhooks/t/forged{i}", content=b"{}")).status_code
                for i in range(30)
            ]
            answers = []
            for i in range(8):
                body, headers = signed_callback(f"resp_team_{i}")
                answers.append(await team_a.post(genuine, content=body, headers=headers))
        # (a slow machine may cross into the next second: then more get through)
        assert codes[:5] == [404] * 5 and codes.count(429) >= 20, codes
        team_codes = [r.status_code for r in answers]
        assert team_codes[:5] == [202] * 5 and 429 in team_codes, team_codes
        text = metrics.render().decode()
        # before its token is checked, a refused request has no known provider
        assert 'nopoll_callbacks_total{outcome="rate_limited",provider="unknown"}' in text


async def test_junk_to_one_tenants_endpoint_leaves_the_others_provider_budget_alone(
    make_settings, redis_url, signed_callback, webhook_secret
):
    """``api.provider_rps`` is counted per endpoint: a team holding its own endpoint that
    floods it with unsigned junk gets 429 there, and the default tenant's genuine callbacks
    to the same provider still get 202."""
    settings = _with_team_a(make_settings, redis_url, webhook_secret, provider_rps=4)
    own = endpoint_path(endpoint_token(settings, "team-a", "sim"))
    async with running_api(settings, redis_url) as (base, _):
        async with _client(base, "127.0.0.10") as team_a, _client(base, "127.0.0.11") as other:
            await _at_the_start_of_a_second()
            junk = [(await team_a.post(own, content=b"{}")).status_code for _ in range(12)]
            answers = await _send(other, signed_callback, 3, "resp_default")
        assert 429 in junk, junk
        assert [r.status_code for r in answers] == [202] * 3, [r.text for r in answers]
