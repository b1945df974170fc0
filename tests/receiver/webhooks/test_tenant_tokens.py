"""Tenant endpoints: the signed ``/webhooks/t/{token}`` tokens, forged ones answered 404
before Redis is touched, key rotation, per-tenant job ids and dedupe, routes on ``tenant``,
``nopoll endpoint`` and the admin API's ``tenant``."""

from __future__ import annotations

import base64
import contextlib
import secrets
from pathlib import Path

import httpx
import pytest
import yaml
from arq.jobs import deserialize_job
from itsdangerous import URLSafeSerializer

from nopoll.envelope import envelope_from_response
from nopoll.exceptions import ConfigError
from receiver.cli import main
from receiver.config.accounts import scoped, tenant_provider
from receiver.config.settings import RouteConfig, load_settings
from receiver.demo.simulator import make_response
from receiver.fanout.routing import Router
from receiver.queue._arq import job_deserializer
from receiver.queue.enqueue import JOBS_QUEUE
from receiver.webhooks.tenants import TOKEN_SALT, endpoint_path, endpoint_token, read_token
from tests.servers import running_api

OLD_KEY = "old-tenant-key-" + "o" * 32
NEW_KEY = "new-tenant-key-" + "n" * 32
OTHER_KEY = "someone-elses-key-" + "x" * 32
ADMIN = "admin-token-0123456789"


def whsec() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


@pytest.fixture
def tenant_secret() -> str:
    return whsec()


@pytest.fixture
def tenant_settings(make_settings, redis_url, webhook_secret, tenant_secret):
    """Factory: provider ``sim`` (and ``quiet``, no callbacks), tenants ``team-a`` (its own
    key and secret at sim) and ``team-b`` (at quiet only)."""

    def make(keys=(OLD_KEY,), **overrides):
        sim = {
            "dialect": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "api_key": "sk-test-not-a-real-key",
            "webhook_secrets": [webhook_secret],
        }
        team_a = {"api_key": "sk-team-a", "webhook_secrets": [tenant_secret]}
        raw = {
            "providers": {"sim": sim, "quiet": {"dialect": "openai", "base_url": sim["base_url"]}},
            "tenants": {
                "team-a": {"providers": {"sim": team_a}},
                "team-b": {"providers": {"quiet": {"api_key": "sk-team-b"}}},
            },
            "tenant_keys": list(keys),
            "admin_tokens": [ADMIN],
            **overrides,
        }
        return make_settings(redis_url=redis_url, **raw)

    return make


@contextlib.asynccontextmanager
async def serving(settings, redis_url, **client_options):
    """An httpx client on the app under a real server; ``client.metrics``: its metrics."""
    async with (
        running_api(settings, redis_url) as (base, metrics),
        httpx.AsyncClient(base_url=base, timeout=10, **client_options) as client,
    ):
        client.metrics = metrics  # type: ignore[attr-defined]
        yield client


def keys_of(redis_sync_client) -> set[bytes]:
    return set(redis_sync_client.keys("*"))


# -- tokens ------------------------------------------------------------------------------


def test_a_token_names_tenant_and_provider_and_reads_back(tenant_settings):
    settings = tenant_settings()
    token = endpoint_token(settings, "team-a", "sim")
    assert read_token(settings, token) == ("team-a", "sim")
    assert endpoint_path(token) == f"/webhooks/t/{token}"
    assert set(token) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")


def forged_tokens(settings) -> dict[str, str]:
    """Every way a token can be wrong, each from a genuine one or a genuine payload."""
    token = endpoint_token(settings, "team-a", "sim")
    payload, _, signature = token.rpartition(".")
    edited = base64.urlsafe_b64encode(b'{"t":"team-b","p":"sim"}').rstrip(b"=").decode()
    ours = URLSafeSerializer(OLD_KEY, salt=TOKEN_SALT)
    flipped = signature[:-1] + ("A" if signature[-1] != "A" else "B")
    return {
        "bad signature": f"{payload}.{flipped}",
        "signed by another key": URLSafeSerializer(OTHER_KEY, salt=TOKEN_SALT).dumps(
            {"t": "team-a", "p": "sim"}
        ),
        "truncated": token[:-6],
        "signature cut off": payload,
        "payload only with dot": payload + ".",
        "payload edited": f"{edited}.{signature}",
        "payload edited, re-signed with a wrong key": URLSafeSerializer(
            OTHER_KEY, salt=TOKEN_SALT
        ).dumps({"t": "team-b", "p": "sim"}),
        "wrong salt": URLSafeSerializer(OLD_KEY, salt="nopoll.something-else").dumps(
            {"t": "team-a", "p": "sim"}
        ),
        "no salt": URLSafeSerializer(OLD_KEY).dumps({"t": "team-a", "p": "sim"}),
        "unknown tenant": ours.dumps({"t": "ghost", "p": "sim"}),
        "tenant without that provider": ours.dumps({"t": "team-b", "p": "sim"}),
        "unknown provider": ours.dumps({"t": "team-a", "p": "nope"}),
        "the default tenant": ours.dumps({"t": "default", "p": "sim"}),
        "extra field": ours.dumps({"t": "team-a", "p": "sim", "x": 1}),
        "not an object": ours.dumps(["team-a", "sim"]),
        "empty": "",
        "garbage": "not a token at all",
        "too long": "a" * 600 + "." + signature,
    }


def test_forged_tokens_read_as_none(tenant_settings):
    settings = tenant_settings()
    for why, token in forged_tokens(settings).items():
        assert read_token(settings, token) is None, why


def test_the_first_key_signs_and_every_key_verifies(tenant_settings):
    old = tenant_settings(keys=[OLD_KEY])
    rotated = tenant_settings(keys=[NEW_KEY, OLD_KEY])
    old_token = endpoint_token(old, "team-a", "sim")
    new_token = endpoint_token(rotated, "team-a", "sim")
    assert new_token != old_token
    assert read_token(rotated, old_token) == ("team-a", "sim")  # old endpoints keep working
    assert read_token(rotated, new_token) == ("team-a", "sim")
    assert URLSafeSerializer(NEW_KEY, salt=TOKEN_SALT).loads(new_token) == {
        "t": "team-a",
        "p": "sim",
    }
    assert read_token(old, new_token) is None  # signed by the new key, not the old one
    assert read_token(tenant_settings(keys=[NEW_KEY]), old_token) is None  # old key retired


def test_endpoint_token_refuses_what_it_cannot_sign(tenant_settings):
    settings = tenant_settings()
    for tenant, provider, message in [
        ("ghost", "sim", "unknown tenant 'ghost'"),
        ("team-b", "sim", "tenant 'team-b' has no account at provider 'sim'"),
        ("team-a", "nope", "unknown provider 'nope'"),
        ("default", "sim", "/webhooks/sim"),
    ]:
        with pytest.raises(ConfigError, match=message):
            endpoint_token(settings, tenant, provider)


def test_a_tenant_account_overrides_the_providers_key_and_secrets(tenant_settings, tenant_secret):
    settings = tenant_settings()
    a = tenant_provider(settings, "team-a", "sim")
    assert a is not None and a.api_key is not None
    assert a.api_key.get_secret_value() == "sk-team-a"
    assert [s.get_secret_value() for s in a.webhook_secrets] == [tenant_secret]
    assert a.base_url == settings.providers["sim"].base_url
    b = tenant_provider(settings, "team-b", "quiet")
    assert b is not None and b.api_key is not None and b.api_key.get_secret_value() == "sk-team-b"
    assert tenant_provider(settings, "team-b", "sim") is None
    assert tenant_provider(settings, "default", "sim") is settings.providers["sim"]
    assert scoped("sim", "default") == "sim" and scoped("sim", "team-a") == "sim@team-a"


def test_tenant_config_mistakes_are_named(tenant_settings):
    with pytest.raises(ValueError, match="'default' is the providers' own account"):
        tenant_settings(tenants={"default": {"providers": {}}})
    with pytest.raises(ValueError, match=r"routes\.0\.match\.tenant: no tenant 'ghost'"):
        tenant_settings(routes=[{"match": {"tenant": "ghost"}, "sinks": ["files"]}])
    with pytest.raises(ValueError, match="base64"):
        tenant_settings(
            tenants={"team-a": {"providers": {"sim": {"webhook_secrets": ["whsec_***"]}}}}
        )


def test_routes_match_on_tenant():
    def env(tenant: str):
        body = make_response("resp_1")
        return envelope_from_response(
            body, provider="sim", received_at="2026-01-01T00:00:00.000Z", tenant=tenant
        )

    routes = [
        RouteConfig.model_validate({"match": {"tenant": "team-a"}, "sinks": ["a"]}),
        RouteConfig.model_validate({"match": {"tenant": ["default", "team-b"]}, "sinks": ["db"]}),
    ]
    router = Router(routes, ["a", "db"])
    assert router.sinks_for(env("team-a")) == ("a",)
    assert router.sinks_for(env("default")) == ("db",)
    assert router.sinks_for(env("team-b")) == ("db",)
    assert router.sinks_for(env("team-c")) == ()


# -- the endpoint ------------------------------------------------------------------------


async def test_every_forged_token_is_404_and_touches_nothing_in_redis(
    tenant_settings, redis_url, redis_sync_client, signed_callback, tenant_secret
):
    settings = tenant_settings()
    body, headers = signed_callback("resp_forged", secret=tenant_secret)
    async with serving(settings, redis_url) as client:
        before = keys_of(redis_sync_client)
        assert redis_sync_client.dbsize() == len(before)
        for why, token in forged_tokens(settings).items():
            r = await client.post(f"/webhooks/t/{token}", content=body, headers=headers)
            assert r.status_code == 404, (why, r.text)
            assert r.json() == {"error": "unknown endpoint"}, why
            assert keys_of(redis_sync_client) == before, why
        assert redis_sync_client.dbsize() == len(before)
        # the genuine token, for contrast: queued
        genuine = endpoint_path(endpoint_token(settings, "team-a", "sim"))
        r = await client.post(genuine, content=body, headers=headers)
        assert r.status_code == 202, r.text
        assert keys_of(redis_sync_client) != before
    assert (
        'nopoll_callbacks_total{outcome="404",provider="unknown"}'
        in client.metrics.render().decode()
    )


async def test_a_tenant_callback_is_queued_with_its_tenant_and_its_own_ids(
    tenant_settings, redis_url, redis_sync_client, signed_callback, tenant_secret
):
    settings = tenant_settings()
    path = endpoint_path(endpoint_token(settings, "team-a", "sim"))
    tenant_body, tenant_headers = signed_callback(
        "resp_same", msg_id="msg_same", secret=tenant_secret
    )
    body, headers = signed_callback("resp_same", msg_id="msg_same")
    async with serving(settings, redis_url) as client:
        r = await client.post(path, content=tenant_body, headers=tenant_headers)
        assert r.status_code == 202 and r.json() == {"status": "queued", "id": "resp_same"}
        # the same webhook-id and response id for the default tenant: not a duplicate
        r = await client.post("/webhooks/sim", content=body, headers=headers)
        assert r.status_code == 202 and r.json()["status"] == "queued"
        # each one's own retry is its own duplicate
        r = await client.post(path, content=tenant_body, headers=tenant_headers)
        assert r.status_code == 200 and r.json() == {"status": "duplicate"}
        r = await client.post("/webhooks/sim", content=body, headers=headers)
        assert r.status_code == 200 and r.json() == {"status": "duplicate"}
    assert set(redis_sync_client.zrange(JOBS_QUEUE, 0, -1)) == {
        b"resp:sim:resp_same",  # the default tenant's ids are what they always were
        b"resp:sim@team-a:resp_same",
    }
    job = deserialize_job(
        redis_sync_client.get("arq:job:resp:sim@team-a:resp_same"), deserializer=job_deserializer
    )
    assert job.kwargs["tenant"] == "team-a" and job.kwargs["provider"] == "sim"
    default_job = deserialize_job(
        redis_sync_client.get("arq:job:resp:sim:resp_same"), deserializer=job_deserializer
    )
    assert "tenant" not in default_job.kwargs  # byte for byte the job of before


async def test_each_endpoint_verifies_with_its_own_secrets(
    tenant_settings, redis_url, redis_sync_client, signed_callback, tenant_secret
):
    settings = tenant_settings()
    path = endpoint_path(endpoint_token(settings, "team-a", "sim"))
    async with serving(settings, redis_url) as client:
        body, headers = signed_callback("resp_x")  # the provider's own secret
        r = await client.post(path, content=body, headers=headers)
        assert r.status_code == 401
        body, headers = signed_callback("resp_x", secret=tenant_secret)
        r = await client.post("/webhooks/sim", content=body, headers=headers)
        assert r.status_code == 401
        # team-b's account at quiet has no webhook secrets (nor has quiet): no callbacks
        quiet = endpoint_path(endpoint_token(settings, "team-b", "quiet"))
        r = await client.post(quiet, content=body, headers=headers)
        assert r.status_code == 404 and "no webhook_secrets" in r.json()["error"]
        # other methods on the tenant route: 405, as on /webhooks/{provider}
        assert (await client.get(path)).status_code == 405
    assert redis_sync_client.zcard(JOBS_QUEUE) == 0


async def test_an_endpoint_signed_by_the_old_key_works_after_a_new_key_is_prepended(
    tenant_settings, redis_url, signed_callback, tenant_secret
):
    old_path = endpoint_path(endpoint_token(tenant_settings(keys=[OLD_KEY]), "team-a", "sim"))
    rotated = tenant_settings(keys=[NEW_KEY, OLD_KEY])
    new_path = endpoint_path(endpoint_token(rotated, "team-a", "sim"))
    async with serving(rotated, redis_url) as client:
        for i, path in enumerate((old_path, new_path)):
            body, headers = signed_callback(f"resp_rot{i}", secret=tenant_secret)
            r = await client.post(path, content=body, headers=headers)
            assert r.status_code == 202, r.text


# -- nopoll endpoint, the admin API -------------------------------------------------------


def write_config(tmp_path: Path, **extra) -> Path:
    raw = {
        "providers": {
            "sim": {"dialect": "openai", "base_url": "http://127.0.0.1:9/v1"},
            "quiet": {"dialect": "openai", "base_url": "http://127.0.0.1:9/v1"},
        },
        "tenants": {
            "team-a": {"providers": {"sim": {"api_key": "sk-a", "webhook_secrets": [whsec()]}}},
            "team-b": {"providers": {"quiet": {"api_key": "sk-b"}}},
        },
        "tenant_keys": [OLD_KEY],
        "data_dir": str(tmp_path / "data"),
        **extra,
    }
    path = tmp_path / "nopoll.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_nopoll_endpoint_prints_the_path_and_the_full_url(tmp_path, capsys):
    config = write_config(tmp_path, public_url="https://nopoll.example.com/")
    assert (
        main(["endpoint", "--config", str(config), "--tenant", "team-a", "--provider", "sim"]) == 0
    )
    path, url = capsys.readouterr().out.splitlines()
    token = path.removeprefix("/webhooks/t/")
    assert path.startswith("/webhooks/t/") and url == f"https://nopoll.example.com{path}"
    assert read_token(load_settings(config, env={}), token) == ("team-a", "sim")

    config = write_config(tmp_path)  # no public_url: the path only
    assert (
        main(["endpoint", "--config", str(config), "--tenant", "team-a", "--provider", "sim"]) == 0
    )
    assert capsys.readouterr().out.splitlines() == [path]

    assert (
        main(["endpoint", "--config", str(config), "--tenant", "team-b", "--provider", "quiet"])
        == 0
    )
    out = capsys.readouterr()
    assert out.out.startswith("/webhooks/t/") and "no webhook_secrets" in out.err


@pytest.mark.parametrize(
    ("tenant", "provider", "extra", "message"),
    [
        ("ghost", "sim", {}, "unknown tenant 'ghost'"),
        ("team-a", "nope", {}, "unknown provider 'nope'"),
        ("team-b", "sim", {}, "tenant 'team-b' has no account at provider 'sim'"),
        ("team-a", "sim", {"tenant_keys": []}, "tenants need tenant_keys"),
        ("team-a", "sim", {"tenant_keys": ["short"]}, "at least 32 characters"),
    ],
)
def test_nopoll_endpoint_errors_exit_2_saying_why(
    tmp_path, capsys, tenant, provider, extra, message
):
    config = write_config(tmp_path, **extra)
    code = main(["endpoint", "--config", str(config), "--tenant", tenant, "--provider", provider])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert message in out.err and OLD_KEY not in out.err


async def test_admin_watches_and_submit_take_a_known_tenant(tenant_settings, redis_url):
    settings = tenant_settings()
    auth = {"authorization": f"Bearer {ADMIN}"}
    async with serving(settings, redis_url, headers=auth) as client:
        watch = {"provider": "sim", "kind": "response", "ids": ["resp_w1"]}
        r = await client.post("/admin/v1/watches", json={**watch, "tenant": "ghost"})
        assert r.status_code == 400 and r.json()["error"].startswith("tenant: unknown tenant")
        r = await client.post("/admin/v1/watches", json={**watch, "tenant": "team-b"})
        assert r.status_code == 400 and "no account at provider 'sim'" in r.json()["error"]
        r = await client.post("/admin/v1/watches", json={**watch, "tenant": "team-a"})
        assert r.status_code == 202 and r.json()["watching"] == 1
        r = await client.post("/admin/v1/watches", json={**watch, "ids": ["resp_w2"]})
        assert r.status_code == 202
        listed = (await client.get("/admin/v1/watches?tenant=*")).json()["watches"]
        assert {(w["id"], w["tenant"]) for w in listed} == {
            ("resp_w1", "team-a"),
            ("resp_w2", "default"),
        }
        for tenant, query in (
            ("default", ""),
            ("default", "?tenant=default"),
            ("team-a", "?tenant=team-a"),
        ):
            listed = (await client.get(f"/admin/v1/watches{query}")).json()["watches"]
            assert {w["tenant"] for w in listed} == {tenant}, query
        submit = {"provider": "sim", "requests": [{"model": "m", "input": "x"}]}
        r = await client.post("/admin/v1/submit", json={**submit, "tenant": "ghost"})
        assert r.status_code == 400 and r.json()["error"].startswith("tenant: unknown tenant")
