"""Completion webhooks (Sail, Valar) at the endpoint, from the outside: a real nopoll API
under uvicorn and a real Redis. The token is the account's own (a tenant's never opens the
default endpoint, nor the reverse); a push is deduped by its response id; the body is read
under the callbacks' limits; every refusal says why, and nothing a client sends is a 500."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from receiver.config.settings import load_settings
from receiver.providers.push import PushTokens
from receiver.queue.jobs import FETCH_RESPONSE, response_job_id
from receiver.redis import RedisConnector
from receiver.webhooks.tenants import endpoint_path, endpoint_token
from tests.servers import free_port, running_api

TENANT_KEY = "tenant-key-" + "k" * 40


def _settings(tmp_path, redis_url: str, **provider: Any):
    raw = {
        "redis_url": redis_url,
        "data_dir": str(tmp_path / "data"),
        "max_body_bytes": 4096,
        "public_url": "https://nopoll.example.com",
        "providers": {
            "sim": {
                "dialect": "sail",
                "base_url": "http://127.0.0.1:9/v1",
                "api_key": "sk-default-0000",
                **provider,
            },
            "oa": {"dialect": "openai", "base_url": "http://127.0.0.1:9/v1"},
        },
        "tenants": {"team-a": {"providers": {"sim": {"api_key": "sk-team-a-0000"}}}},
        "tenant_keys": [TENANT_KEY],
        "sinks": {"files": {"type": "jsonl", "dir": str(tmp_path / "results")}},
    }
    return load_settings(None, env={}, overrides=raw)


async def _token(redis_url: str, account: str) -> str:
    connector = RedisConnector.from_url(redis_url)
    redis = connector.client("api")
    try:
        return await PushTokens(redis).token(account)
    finally:
        await redis.aclose()
        await connector.aclose()


def _response(rid: str = "resp_pushed_1", **more: Any) -> bytes:
    obj = {"id": rid, "object": "response", "status": "completed", "output": [], **more}
    return orjson.dumps(obj)


async def _push(base: str, path: str, body: bytes, token: str | None, **headers: str):
    sent = {"content-type": "application/json", **headers}
    if token is not None:
        sent["authorization"] = f"Bearer {token}"
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(base + path, content=body, headers=sent)


async def test_a_push_with_the_accounts_token_is_queued_once(
    tmp_path, redis_url, redis_sync_client
) -> None:
    settings = _settings(tmp_path, redis_url)
    token = await _token(redis_url, "sim")
    async with running_api(settings, redis_url) as (base, _):
        first = await _push(base, "/webhooks/sim", _response(), token)
        again = await _push(base, "/webhooks/sim", _response(usage={"input_tokens": 1}), token)
    assert first.status_code == 202, first.text
    assert first.json() == {"status": "queued", "id": "resp_pushed_1"}
    assert again.status_code == 200 and again.json() == {"status": "duplicate"}
    job = redis_sync_client.get("arq:job:" + response_job_id("sim", "resp_pushed_1"))
    assert job is not None and FETCH_RESPONSE.encode() in job
    assert token.encode() not in job  # fetched by id: the body, and its echo, are not kept


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({}, "needs one Authorization: Bearer"),
        ({"authorization": "Bearer not-the-token"}, "not the webhook_token"),
        ({"authorization": "Basic dXNlcjpwYXNz"}, "needs one Authorization: Bearer"),
        ({"authorization": "Bearer"}, "needs one Authorization: Bearer"),
    ],
)
async def test_a_push_without_the_accounts_token_is_401_with_a_reason(
    tmp_path, redis_url, redis_sync_client, headers, why
) -> None:
    settings = _settings(tmp_path, redis_url)
    await _token(redis_url, "sim")
    async with running_api(settings, redis_url) as (base, _):
        r = await _push(base, "/webhooks/sim", _response(), None, **headers)
    assert r.status_code == 401 and why in r.json()["error"]
    assert not redis_sync_client.keys("arq:job:*")


async def test_tokens_are_per_account_a_tenants_never_opens_another_endpoint(
    tmp_path, redis_url, redis_sync_client
) -> None:
    settings = _settings(tmp_path, redis_url)
    default_token = await _token(redis_url, "sim")
    tenant_token = await _token(redis_url, "sim@team-a")
    assert default_token != tenant_token
    tenant_path = endpoint_path(endpoint_token(settings, "team-a", "sim"))
    async with running_api(settings, redis_url) as (base, _):
        crossed = [
            await _push(base, "/webhooks/sim", _response("resp_a"), tenant_token),
            await _push(base, tenant_path, _response("resp_b"), default_token),
        ]
        own = await _push(base, tenant_path, _response("resp_c"), tenant_token)
    assert [r.status_code for r in crossed] == [401, 401]
    assert own.status_code == 202, own.text
    jobs = sorted(k.decode() for k in redis_sync_client.keys("arq:job:*"))
    assert jobs == ["arq:job:" + response_job_id("sim@team-a", "resp_c")]


@pytest.mark.parametrize(
    ("body", "status", "why"),
    [
        (b"x" * 5000, 413, "larger than 4096 bytes"),
        (b"not json", 400, "not UTF-8 JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (_response("../../etc/passwd"), 400, "id must match"),
        (orjson.dumps({"status": "completed"}), 400, "id must match"),
    ],
)
async def test_a_bad_push_body_gets_a_reason_and_queues_nothing(
    tmp_path, redis_url, redis_sync_client, body, status, why
) -> None:
    settings = _settings(tmp_path, redis_url)
    token = await _token(redis_url, "sim")
    async with running_api(settings, redis_url) as (base, _):
        r = await _push(base, "/webhooks/sim", body, token)
    assert r.status_code == status and why in r.json()["error"], r.text
    assert not redis_sync_client.keys("arq:job:*")


async def test_pushes_switched_off_or_not_pushed_by_the_dialect_are_404(
    tmp_path, redis_url
) -> None:
    settings = _settings(tmp_path, redis_url, completion_webhook={"enabled": False})
    token = await _token(redis_url, "sim")
    async with running_api(settings, redis_url) as (base, _):
        off = await _push(base, "/webhooks/sim", _response(), token)
        openai = await _push(base, "/webhooks/oa", _response(), token)
    assert off.status_code == 404 and "takes no callbacks" in off.json()["error"]
    assert openai.status_code == 404


def test_completion_webhook_is_refused_for_a_dialect_that_pushes_nothing(tmp_path) -> None:
    with pytest.raises(Exception, match="completion_webhook: only the sail and valar"):
        load_settings(
            None,
            env={},
            overrides={
                "providers": {
                    "oa": {
                        "dialect": "openai",
                        "base_url": "http://127.0.0.1:9/v1",
                        "completion_webhook": {"enabled": True},
                    }
                }
            },
        )


async def test_a_push_while_redis_is_down_is_503_and_retried_later(tmp_path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    settings = _settings(tmp_path, dead)
    async with running_api(settings, dead) as (base, _):
        r = await _push(base, "/webhooks/sim", _response(), "some-token")
    assert r.status_code == 503 and "retry later" in r.json()["error"]
