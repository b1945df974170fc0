"""sference's completion feed, end to end: ``nopoll submit`` makes a stream, the workers
follow its feed (and the account's own) and land each completion from its event, with no
request per result; the worker holding the feeds is SIGKILLed mid-page and every result
still lands once, in SQL and in S3."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import boto3
import httpx
import orjson
import pytest
import redis as redis_sync

from receiver.config.settings import load_settings
from receiver.feeds.store import ACCOUNT_FEED, feed_key
from receiver.worker.liveness import process_key
from tests.e2e.helpers import nopoll_submit, pg_rows, run_nopoll, wait_for, wait_pg_rows
from tests.s3_server import FAKE_CREDENTIALS
from tests.servers import running_api

pytestmark = pytest.mark.slow

BUCKET = "nopoll-feed"
ADMIN = "feed-admin-token-0123456789"


def _config(tmp_path: Path, sim, redis_url, pg_url, table, *, s3_url=None, feed="") -> Path:
    s3 = (
        f"  lake: {{type: s3, bucket: {BUCKET}, endpoint_url: '{s3_url}', region: us-east-1,"
        f" create_bucket: true, access_key_id: {FAKE_CREDENTIALS['AWS_ACCESS_KEY_ID']},"
        f" secret_access_key: {FAKE_CREDENTIALS['AWS_SECRET_ACCESS_KEY']}}}\n"
        if s3_url
        else ""
    )
    path = tmp_path / "nopoll.yaml"
    path.write_text(
        f"redis_url: '{redis_url}'\n"
        f"data_dir: {tmp_path / 'data'}\n"
        "providers:\n"
        "  sim:\n    dialect: sference\n"
        f"    base_url: {sim.base_url}\n"
        "    watch: {first_poll_s: 0.2, max_interval_s: 1, reconcile_after_s: 600}\n"
        f"    feed: {{wait_ms: 5000, lease_s: 3{feed}}}\n"
        f"sinks:\n  db: {{type: sql, url: '{pg_url}', table: {table}}}\n{s3}"
        "fetch_retry: {max_tries: 5, base_delay_s: 0.1, max_delay_s: 0.5}\n"
        f"admin_tokens: ['{ADMIN}']\n"
        "worker: {poll_delay_s: 0.01, response_job_timeout_s: 30, health_check_interval_s: 1,"
        " shutdown_wait_s: 5}\n"
    )
    return path


def _lines(path: Path, n: int) -> Path:
    with path.open("wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"model": "m-1", "input": f"q {i}", "custom_id": f"q{i:05d}"}))
            f.write(b"\n")
    return path


async def _watch(procs, config, ids: list[str], *extra: str):
    """``nopoll watch`` of sim response ids that expect no poll (the feed lands them)."""
    args = ["watch", "--config", str(config), "sim", "response", *ids, "--expect-callback"]
    return await asyncio.to_thread(run_nopoll, *args, *extra, env=procs.env, timeout=60)


async def test_a_submit_lands_through_the_stream_feed_with_no_request_per_result(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    n = 400
    sim = provider_sim(dialect="sference", complete_after=lambda rid: 1.0 + hash(rid) % 20 / 10)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    procs.start("worker", "--config", str(config))
    source = _lines(tmp_path / "feed.jsonl", n)

    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = await wait_pg_rows(pg_url, pg_table, n, timeout=60)
    assert len({r["key"] for r in rows}) == n
    assert all(r["event_id"].startswith("feed:") for r in rows)  # none by a poll
    assert all(r["status"] == "completed" and r["output_text"] for r in rows)
    assert {r["custom_id"] for r in rows} == {f"q{i:05d}" for i in range(n)}
    # no GET by id, no poll: the feed's long polls only
    assert sim.request_count("/v1/responses/") == sim.request_count("/v1/responses/events")
    assert sim.request_count("/v1/responses/events") / n <= 0.1
    # the admin API (and /ui) show the feed: its holder, the stream's cursor, what landed
    settings = load_settings(config, env={})
    auth = {"authorization": f"Bearer {ADMIN}"}
    async with running_api(settings, redis_url) as (base, _), httpx.AsyncClient() as http:
        [feed] = (await http.get(f"{base}/admin/v1/feeds", headers=auth)).json()["feeds"]
        overview = (await http.get(f"{base}/admin/v1/overview", headers=auth)).json()
        key = rows[0]["key"]
        journey = (await http.get(f"{base}/admin/v1/journey/sim/{key}", headers=auth)).json()
    assert feed["provider"] == "sim" and feed["tenant"] == "default" and feed["holder"]
    assert feed["landed"] == n and feed["lag_s"] is not None and feed["read_ago_s"] < 30
    streams = [f for f in feed["feeds"] if f["stream"] is not None]
    assert len(streams) == 1 and streams[0]["cursor"]
    assert [(f["account"], f["feeds"]) for f in overview["feeds"]] == [("sim", feed["feeds"])]
    # the id's journey says it came from the feed, naming the event
    steps = [e for e in journey["events"] if e["step"] == "fetch"]
    assert [(e["via"], e["status"]) for e in steps] == [("feed", "completed")], journey
    assert rows[0]["event_id"] == f"feed:{steps[0]['event']}"


async def test_the_account_feed_lands_the_ids_watched_and_nothing_else(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    """Responses made outside nopoll's streams (the user's own creates): the account's own
    feed lands the ones watched with expect_callback, before any poll; the others are not
    nopoll's to land."""
    sim = provider_sim(dialect="sference", complete_after_s=6.0)  # watched before they end
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    procs.start("worker", "--config", str(config))
    client = redis_sync.Redis.from_url(redis_url)

    async def following() -> bool:  # the account's feed read once: its cursor is set
        return client.hexists(feed_key("sim", "cursors"), ACCOUNT_FEED)

    await wait_for(following, timeout=30, interval=0.1)
    ids = []
    async with httpx.AsyncClient(timeout=10) as http:
        for i in range(20):
            body = {"model": "m-1", "input": f"own {i}", "background": True}
            r = await http.post(f"{sim.base_url}/responses", json=body)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
    watched = ids[:12]
    done = await _watch(procs, config, watched)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = await wait_pg_rows(pg_url, pg_table, 12, timeout=30)
    await asyncio.sleep(3)  # the 8 others completed too, and stay out
    rows = await pg_rows(pg_url, pg_table)
    client.close()
    assert sorted(r["key"] for r in rows) == sorted(watched)
    assert all(r["event_id"].startswith("feed:") for r in rows)
    assert sim.request_count("/v1/responses/0") == 0  # no poll, no GET by id


async def test_sigkilling_the_feed_holder_mid_page_loses_and_doubles_nothing(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, s3_endpoint
):
    n = 3000
    sim = provider_sim(dialect="sference", complete_after_s=4.0)
    config = _config(
        tmp_path, sim, redis_url, pg_url, pg_table, s3_url=s3_endpoint, feed=", limit: 1000"
    )
    first = procs.start("worker", "--config", str(config))
    client = redis_sync.Redis.from_url(redis_url)

    async def held() -> bytes | None:
        return client.get(feed_key("sim", "hold"))

    holder = await wait_for(held, timeout=30, interval=0.1)
    process = client.get(process_key(holder.decode())).decode()  # <host>/<pid>/<started>
    assert process.split("/")[1] == str(first.pid)
    procs.start("worker", "--config", str(config))  # the one that takes over
    source = _lines(tmp_path / "kill.jsonl", n)
    done = await asyncio.to_thread(nopoll_submit, procs, config, source)
    assert done.returncode == 0, done.stdout + done.stderr

    async def mid_page() -> bool:  # the first page (1000) is being landed
        return 50 <= len(await pg_rows(pg_url, pg_table)) < 900

    await wait_for(mid_page, timeout=60, interval=0.02)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    killed_at = asyncio.get_running_loop().time()

    rows = await wait_pg_rows(pg_url, pg_table, n, timeout=30)
    assert asyncio.get_running_loop().time() - killed_at <= 30
    assert len(rows) == n and len({r["key"] for r in rows}) == n  # once each in SQL
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")

    async def all_in_s3() -> list[str] | None:
        keys: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return keys if len(keys) >= n else None

    keys = await wait_for(all_in_s3, timeout=30, interval=0.5)
    assert sorted(keys) == sorted(f"sim/responses/{r['key']}.json" for r in rows)  # one each
    # the feed moved on from the killed holder's cursor to the last completion, no gap
    new_holder = client.get(feed_key("sim", "hold"))
    assert new_holder is not None and new_holder != holder
    client.close()


async def test_a_watch_registered_after_the_feed_landed_its_id_starts_landed(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    """The feed can land an id before ``nopoll submit`` registers its watch (a fast result,
    a rerun after a kill): the watch must start landed, not wait for the reconcile poll."""
    from receiver.feeds.store import FeedStore
    from receiver.redis import RedisConnector

    sim = provider_sim(dialect="sference", complete_after_s=0.1)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    procs.start("worker", "--config", str(config))
    async with httpx.AsyncClient(timeout=10) as http:
        stream = (await http.post(f"{sim.base_url}/streams", json={"name": "own"})).json()["id"]
        connector = RedisConnector.from_url(redis_url)
        redis = connector.client("api")
        await FeedStore(redis).follow_stream("sim", stream)
        await redis.aclose()
        await connector.aclose()
        ids = []
        for i in range(10):
            body = {"model": "m-1", "input": f"x {i}", "background": True}
            body["metadata"] = {"stream_id": stream}
            ids.append((await http.post(f"{sim.base_url}/responses", json=body)).json()["id"])
    await wait_pg_rows(pg_url, pg_table, 10, timeout=30)  # landed, nobody watching yet
    done = await _watch(procs, config, ids, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "10 landed" in done.stdout and "0 polls" in done.stdout, done.stdout
