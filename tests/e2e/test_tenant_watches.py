"""Watches are the tenant's own, end to end: a real API and worker, the provider simulator,
Postgres. One tenant's callback never touches another tenant's watch of the same id; two
tenants watching one id each land their own result; a tenant account without its own
``api_key`` is refused at start-up."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import httpx
import pytest
import yaml

from receiver.cli import main
from receiver.webhooks.tenants import endpoint_path, endpoint_token
from tests.e2e import test_tenants
from tests.e2e.helpers import NOPOLL, pg_rows, wait_for
from tests.servers import running_api, running_worker

KEYS = test_tenants.KEYS
ADMIN = "admin-token-" + "a" * 20
CONSUMER = "consumer-token-" + "c" * 20
tenant_stack = test_tenants.tenant_stack


def admin(base: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10
    )


async def watches(base: str, **query: str) -> list[dict]:
    async with admin(base) as client:
        answer = await client.get("/admin/v1/watches", params=query)
    assert answer.status_code == 200, answer.text
    return answer.json()["watches"]


async def watch(base: str, object_id: str, tenant: str | None = None) -> httpx.Response:
    body: dict = {"provider": "sim", "kind": "response", "ids": [object_id]}
    async with admin(base) as client:
        return await client.post(
            "/admin/v1/watches", json=body | ({"tenant": tenant} if tenant else {})
        )


def rows_where(pg_url: str, pg_table: str, want: set[str]):
    async def check():
        rows = await pg_rows(pg_url, pg_table)
        return rows if {r["tenant"] for r in rows} >= want else None

    return check


async def test_a_tenants_callback_does_not_pause_the_default_tenants_watch_of_the_same_id(
    tenant_stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, _, sim, tenant_secrets = tenant_stack(admin_tokens=[ADMIN])
    sim.add_response("resp_shared", pending_until=time.time() + 3, text="the default's")
    path = endpoint_path(endpoint_token(settings, "team-a", "sim"))
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        answer = await watch(base, "resp_shared")
        assert answer.status_code == 202 and answer.json()["watching"] == 1
        # team-a's (premature) callback for the same id: its own fetch, its own business
        for msg in ("msg_a1", "msg_a2"):
            body, headers = signed_callback(
                "resp_shared", msg_id=msg, secret=tenant_secrets["team-a"]
            )
            assert (await test_tenants.post_to(base, path, body, headers)).status_code == 202
        await wait_for(
            lambda: _true(sim.request_count("/v1/responses/", api_key=KEYS["team-a"]) >= 2)
        )
        [shown] = await watches(base, provider="sim")
        assert shown["tenant"] == "default"
        assert shown["phase"] in ("pending", "polling"), shown  # not handed to team-a's job
        rows = await wait_for(rows_where(pg_url, pg_table, {"default"}), timeout=30)
        [landed] = await watches(base, provider="sim")
    [row] = [r for r in rows if r["tenant"] == "default"]
    assert (row["key"], row["output_text"], row["event_id"]) == (
        "resp_shared",
        "the default's",
        None,
    )
    assert (landed["state"], landed["tenant"]) == ("landed", "default")
    assert landed["polls"] >= 1  # the default's own polls landed it
    assert sim.request_count("/v1/responses/resp_shared", api_key=KEYS["default"]) >= 1


async def _true(value: bool) -> bool:
    return value


async def test_two_tenants_watching_the_same_id_each_land_their_own_result(
    tenant_stack, redis_url, pg_url, pg_table
):
    settings, config, sim, _ = tenant_stack(
        admin_tokens=[ADMIN], consumer_tokens=[{"token": CONSUMER}]
    )
    sim.add_response("resp_both", pending_until=time.time() + 1.5, text="same id")
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        for tenant in ("default", "team-b"):
            answer = await watch(base, "resp_both", tenant)
            assert answer.status_code == 202, answer.text
            assert answer.json()["watching"] == 1, (tenant, answer.json())
        code = await asyncio.to_thread(
            main,
            ["watch", "--config", str(config), "--tenant", "team-a", "--wait", "sim",
             "response", "resp_both"],
        )  # fmt: skip
        assert code == 0
        rows = await wait_for(
            rows_where(pg_url, pg_table, {"default", "team-a", "team-b"}), timeout=30
        )
        async with httpx.AsyncClient(
            base_url=base, headers={"authorization": f"Bearer {CONSUMER}"}, timeout=10
        ) as consumer:
            results = {
                t: await consumer.get("/v1/results/sim/resp_both", params={"tenant": t})
                for t in ("default", "team-b")
            }
        listed = {t: await watches(base, tenant=t) for t in ("default", "team-a", "team-b")}
        async with admin(base) as client:
            path = "/admin/v1/watches/sim/response/resp_both"
            assert (await client.delete(path, params={"tenant": "team-b"})).status_code == 204
            assert (await client.delete(path, params={"tenant": "team-b"})).status_code == 404
            ghost = await client.delete(path, params={"tenant": "ghost"})
        after = {t: await watches(base, tenant=t) for t in ("default", "team-b")}
    assert sorted((r["tenant"], r["key"], r["event_id"]) for r in rows) == [
        (t, "resp_both", None) for t in ("default", "team-a", "team-b")
    ]
    for key in KEYS.values():  # each tenant's watch polled with its own key
        assert sim.request_count("/v1/responses/resp_both", api_key=key) >= 1
    for tenant, answer in results.items():
        assert answer.status_code == 200, answer.text
        assert answer.json()["tenant"] == tenant
    for tenant, shown in listed.items():
        assert [(w["tenant"], w["id"], w["state"]) for w in shown] == [
            (tenant, "resp_both", "landed")
        ]
    assert ghost.status_code == 404  # a tenant's name, no watch of it
    assert len(after["default"]) == 1 and after["team-b"] == []


def _config_without_tenant_key(tmp_path, redis_url) -> str:
    raw = {
        "redis_url": redis_url,
        "data_dir": str(tmp_path / "data"),
        "providers": {
            "sim": {
                "dialect": "openai",
                "base_url": "http://127.0.0.1:9/v1",
                "api_key": KEYS["default"],
            }
        },
        "tenants": {
            "team-a": {
                "providers": {"sim": {"webhook_secrets": [test_tenants.whsec()]}},
            }
        },
        "tenant_keys": [test_tenants.TENANT_KEY],
    }
    config = tmp_path / "nopoll.yaml"
    config.write_text(yaml.safe_dump(raw))
    return str(config)


@pytest.mark.slow  # four processes start
def test_a_tenant_account_without_its_own_api_key_is_refused_at_start_up(tmp_path, redis_url):
    config = _config_without_tenant_key(tmp_path, redis_url)
    env = {**os.environ}
    for command in (["config", "check"], ["api", "--port", "0"], ["worker"], ["serve"]):
        done = subprocess.run(
            [str(NOPOLL), *command, "--config", config],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "tenants.team-a.providers.sim.api_key" in done.stderr, (command, done.stderr)
        assert "Traceback" not in done.stderr
