"""Tenants end to end, through real servers: each tenant's signed endpoint, its own
secrets, its own API key at the provider (the simulator counts which key fetched what),
rows of its own in Postgres, routes on ``tenant``; ``nopoll watch --tenant`` and
``nopoll submit --tenant``."""

from __future__ import annotations

import asyncio
import base64
import secrets
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from receiver.cli import main
from receiver.config.settings import load_settings
from receiver.submit.creates import file_digest
from receiver.webhooks.tenants import endpoint_path, endpoint_token
from tests.e2e.helpers import jsonl_rows, pg_rows, post, wait_for
from tests.servers import running_api, running_worker

KEYS = {"default": "sk-default-0000", "team-a": "sk-team-a-0000", "team-b": "sk-team-b-0000"}
TENANT_KEY = "tenant-key-" + "k" * 40


def whsec() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


@pytest.fixture
def tenant_stack(tmp_path, redis_url, provider_sim, pg_url, pg_table, webhook_secret):
    """Factory: (settings, config file, simulator, tenant secrets). The simulator takes the
    three accounts' keys and counts which one each request came with."""

    def make(**extra):
        sim = provider_sim(api_key=list(KEYS.values()))
        tenant_secrets = {"team-a": whsec(), "team-b": whsec()}
        watch = {"first_poll_s": 0.2, "max_interval_s": 0.5, "rate_limit_rps": 200}
        raw = {
            "redis_url": redis_url,
            "data_dir": str(tmp_path / "data"),
            "providers": {
                "sim": {
                    "dialect": "openai",
                    "base_url": sim.base_url,
                    "api_key": KEYS["default"],
                    "webhook_secrets": [webhook_secret],
                    "watch": {**watch, "reconcile_after_s": 0.3},
                }
            },
            "tenants": {
                name: {"providers": {"sim": {"api_key": KEYS[name], "webhook_secrets": [secret]}}}
                for name, secret in tenant_secrets.items()
            },
            "tenant_keys": [TENANT_KEY],
            "public_url": "https://nopoll.example.com",
            "sinks": {"warehouse": {"type": "sql", "url": pg_url, "table": pg_table}},
            "fetch_retry": {"max_tries": 3, "base_delay_s": 0.05, "max_delay_s": 0.2},
            "http": {"attempts": 2, "connect_timeout_s": 2, "read_timeout_s": 5},
            "worker": {"poll_delay_s": 0.01, "health_check_interval_s": 1, "shutdown_wait_s": 2},
            **extra,
        }
        config = tmp_path / "nopoll.yaml"
        config.write_text(yaml.safe_dump(raw))
        return load_settings(config, env={}), config, sim, tenant_secrets

    return make


async def post_to(base: str, path: str, body: bytes, headers: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(base + path, content=body, headers=headers)


def rows_of(n: int, pg_url: str, pg_table: str):
    async def check():
        rows = await pg_rows(pg_url, pg_table)
        return rows if len(rows) >= n else None

    return check


async def test_two_tenants_with_the_same_response_id_land_two_rows_each_fetched_with_its_key(
    tenant_stack, redis_url, signed_callback, pg_url, pg_table, tmp_path
):
    routes = [
        {"match": {"tenant": "team-a"}, "sinks": ["files"]},
        {"match": {}, "sinks": ["warehouse"]},
    ]
    settings, _, sim, tenant_secrets = tenant_stack(
        sinks={
            "warehouse": {"type": "sql", "url": pg_url, "table": pg_table},
            "files": {"type": "jsonl", "dir": str(tmp_path / "results")},
        },
        routes=routes,
    )
    sim.add_response("resp_same", text="one answer")
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        # the same response id and webhook-id for all three: none is another's duplicate
        assert (await post(base, *signed_callback("resp_same", msg_id="msg_1"))).status_code == 202
        for tenant, secret in tenant_secrets.items():
            path = endpoint_path(endpoint_token(settings, tenant, "sim"))
            body, headers = signed_callback("resp_same", msg_id="msg_1", secret=secret)
            assert (await post_to(base, path, body, headers)).status_code == 202
        rows = await wait_for(rows_of(3, pg_url, pg_table))
        await asyncio.sleep(0.3)  # nothing more comes
        rows = await pg_rows(pg_url, pg_table)
    assert sorted((r["tenant"], r["key"], r["status"]) for r in rows) == [
        ("default", "resp_same", "completed"),
        ("team-a", "resp_same", "completed"),
        ("team-b", "resp_same", "completed"),
    ]
    for key in KEYS.values():  # one GET each, each account with its own key
        assert sim.request_count("/v1/responses/resp_same", api_key=key) == 1
    assert sim.request_count("/v1/responses/resp_same") == 3
    # the route on tenant: team-a's result (only) went to the files sink too
    assert [(f["tenant"], f["key"]) for f in jsonl_rows(tmp_path / "results")] == [
        ("team-a", "resp_same")
    ]


async def test_two_tenants_with_the_same_batch_id_each_land_their_rows(
    tenant_stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, _, sim, tenant_secrets = tenant_stack()
    sim.add_batch("openai", "batch_same", 4)
    path = endpoint_path(endpoint_token(settings, "team-a", "sim"))
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        body, headers = signed_callback("batch_same", event_type="batch.completed")
        assert (await post(base, body, headers)).status_code == 202
        body, headers = signed_callback(
            "batch_same", event_type="batch.completed", secret=tenant_secrets["team-a"]
        )
        assert (await post_to(base, path, body, headers)).status_code == 202
        rows = await wait_for(rows_of(10, pg_url, pg_table))  # 4 rows + 1 summary, twice
    kinds = sorted((r["tenant"], r["kind"]) for r in rows)
    assert kinds == sorted(
        [(t, "batch_row") for t in ("default", "team-a") for _ in range(4)]
        + [("default", "batch"), ("team-a", "batch")]
    )
    assert sim.request_count("/v1/batches/batch_same", api_key=KEYS["team-a"]) >= 1
    assert sim.request_count("/v1/batches/batch_same", api_key=KEYS["default"]) >= 1
    assert sim.request_count("/v1/batches/batch_same", api_key=KEYS["team-b"]) == 0


async def test_the_endpoint_nopoll_endpoint_prints_takes_the_tenants_callbacks(
    tenant_stack, redis_url, signed_callback, pg_url, pg_table, capsys
):
    settings, config, sim, tenant_secrets = tenant_stack()
    sim.add_response("resp_cli")
    args = ["endpoint", "--config", str(config), "--tenant", "team-b", "--provider", "sim"]
    assert main(args) == 0
    path, url = capsys.readouterr().out.splitlines()
    assert url == "https://nopoll.example.com" + path
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        body, headers = signed_callback("resp_cli", secret=tenant_secrets["team-b"])
        assert (await post_to(base, path, body, headers)).status_code == 202
        rows = await wait_for(rows_of(1, pg_url, pg_table))
    assert [(r["tenant"], r["key"]) for r in rows] == [("team-b", "resp_cli")]
    assert sim.request_count("/v1/responses/resp_cli", api_key=KEYS["team-b"]) == 1


def run_cli(*args: str) -> int:
    return main(list(args))


async def test_nopoll_watch_with_tenant_polls_with_the_tenants_key(
    tenant_stack, redis_url, pg_url, pg_table
):
    settings, config, sim, _ = tenant_stack()
    sim.add_response("resp_watched", pending_times=1, text="later")
    async with running_worker(settings, redis_url):
        code = await asyncio.to_thread(
            run_cli, "watch", "--config", str(config), "--tenant", "team-a", "sim", "response",
            "resp_watched",
        )  # fmt: skip
        assert code == 0
        rows = await wait_for(rows_of(1, pg_url, pg_table))
    assert [(r["tenant"], r["key"], r["output_text"]) for r in rows] == [
        ("team-a", "resp_watched", "later")
    ]
    polls = sim.request_count("/v1/responses/resp_watched")
    assert polls >= 2 and sim.request_count("/v1/responses/", api_key=KEYS["team-a"]) == polls
    code = await asyncio.to_thread(
        run_cli, "watch", "--config", str(config), "--tenant", "ghost", "sim", "response", "r1"
    )
    assert code == 2


async def test_nopoll_submit_with_tenant_creates_with_its_key_and_keeps_its_own_records(
    tenant_stack, redis_url, redis_sync_client, pg_url, pg_table, tmp_path
):
    settings, config, sim, _ = tenant_stack()
    source = tmp_path / "requests.jsonl"
    source.write_bytes(
        b"".join(
            orjson.dumps({"model": "m-1", "input": f"q{i}", "custom_id": f"c{i}"}) + b"\n"
            for i in range(3)
        )
    )
    digest = file_digest(Path(source))
    async with running_worker(settings, redis_url):
        submit = ["submit", "--config", str(config), "sim", str(source)]
        assert await asyncio.to_thread(run_cli, *submit, "--tenant", "team-a") == 0
        assert sim.creations("responses") == 3
        assert sim.request_count("/v1/responses", api_key=KEYS["team-a"]) >= 3
        assert redis_sync_client.hlen(f"nopoll:submit:sim@team-a:{digest}") == 3
        assert not redis_sync_client.exists(f"nopoll:submit:sim:{digest}")
        rows = await wait_for(rows_of(3, pg_url, pg_table))
        assert {r["tenant"] for r in rows} == {"team-a"}
        # the same file for the default tenant: its own records and keys, created again
        assert await asyncio.to_thread(run_cli, *submit) == 0
        assert sim.creations("responses") == 6
        assert redis_sync_client.hlen(f"nopoll:submit:sim:{digest}") == 3
        # and for team-a again: nothing new
        assert await asyncio.to_thread(run_cli, *submit, "--tenant", "team-a") == 0
        assert sim.creations("responses") == 6
        rows = await wait_for(rows_of(6, pg_url, pg_table))
    assert sorted(r["tenant"] for r in rows) == ["default"] * 3 + ["team-a"] * 3
    keys = {r.idempotency_key for r in sim.creates.received("/v1/responses")}
    assert len(keys) == 6  # a tenant's idempotency keys are its own
    team_a_gets = sim.request_count("/v1/responses/", api_key=KEYS["team-a"])
    default_gets = sim.request_count("/v1/responses/", api_key=KEYS["default"])
    assert team_a_gets >= 3 and default_gets >= 3
    assert sim.request_count("/v1/responses", api_key=KEYS["team-b"]) == 0
