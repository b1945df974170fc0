"""The whole path through real servers: signed callback → Redis → worker → provider → sinks."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from receiver.queue._arq import RETRY_KEY, arq_pool
from receiver.queue.deadletter import DeadLetters
from receiver.redis import RedisConnector
from tests.e2e.helpers import jsonl_rows, pg_rows, post, wait_for, worker_started
from tests.servers import TcpProxy, running_api, running_worker


@pytest.fixture
def stack(make_settings, redis_url, provider_sim, pg_url, pg_table, tmp_path):
    """Factory for (settings, sim): Postgres + JSONL sinks, the simulator as provider."""

    def make(pg_port_url: str | None = None, **overrides):
        sim = provider_sim(api_key="sk-test-not-a-real-key")
        sinks = {
            "warehouse": {
                "type": "sql",
                "url": pg_port_url or pg_url,
                "table": pg_table,
                "timeout_s": 3,
            },
            "files": {"type": "jsonl", "dir": str(tmp_path / "results")},
        }
        return make_settings(sim.base_url, redis_url=redis_url, sinks=sinks, **overrides), sim

    return make


async def delivery_tries_at_least(redis_url: str, tries: int) -> bool:
    """True once some delivery job (a sink's own retry) has started ``tries`` times."""
    pool = arq_pool(RedisConnector.from_url(redis_url))
    try:
        keys = [k async for k in pool.scan_iter(match=RETRY_KEY + "deliver:*")]
        counts = await pool.mget(keys) if keys else []
        return any(int(c) >= tries for c in counts if c is not None)
    finally:
        await pool.aclose()


async def test_callback_becomes_one_row_in_every_sink(
    stack, redis_url, signed_callback, pg_url, pg_table, tmp_path
):
    settings, sim = stack()
    sim.add_response("resp_e2e", text="hello world", metadata={"label": "eval"})
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        body, headers = signed_callback("resp_e2e")
        assert (await post(base, body, headers)).status_code == 202
        assert (await post(base, body, headers)).status_code == 200  # provider retry
        rows = await wait_for(lambda: pg_rows(pg_url, pg_table))
    assert len(rows) == 1
    row = rows[0]
    assert (row["provider"], row["key"], row["kind"], row["status"]) == (
        "sim",
        "resp_e2e",
        "response",
        "completed",
    )
    assert row["usable"] is True and row["output_text"] == "hello world"
    assert json.loads(row["metadata"]) == {"label": "eval"}
    assert row["event_id"] == headers["webhook-id"]
    assert (row["input_tokens"], row["output_tokens"]) == (21, 7)
    assert json.loads(row["body"])["id"] == "resp_e2e"
    files = jsonl_rows(tmp_path / "results")
    assert [f["key"] for f in files] == ["resp_e2e"]
    assert sim.request_count("/v1/responses/") == 1  # one provider request per result


async def test_provider_429_then_200(stack, redis_url, signed_callback, pg_url, pg_table):
    settings, sim = stack()
    sim.add_response("resp_busy", fail_times=1, fail_status=429, retry_after=0.2)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        started = time.monotonic()
        assert (await post(base, *signed_callback("resp_busy"))).status_code == 202
        rows = await wait_for(lambda: pg_rows(pg_url, pg_table))
        waited = time.monotonic() - started
    assert [r["key"] for r in rows] == ["resp_busy"]
    assert sim.request_count("/v1/responses/resp_busy") == 2
    assert waited >= 0.2  # Retry-After was honoured


async def test_provider_500_until_last_try_dead_letters_then_replay(
    stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, sim = stack()
    # 3 job tries, one request each (no in-job retries that would multiply them), all failing
    broken = sim.add_response("resp_down", fail_times=3, fail_status=500)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        assert (await post(base, *signed_callback("resp_down"))).status_code == 202
        pool = arq_pool(RedisConnector.from_url(redis_url))
        letters = DeadLetters(pool)
        found = await wait_for(letters.find)
        assert len(found) == 1
        letter = found[0]
        assert (letter.sink, letter.keys, letter.attempts) == ("fetch", ["resp_down"], 3)
        assert "500" in letter.error and "sk-test" not in letter.error
        assert await pg_rows(pg_url, pg_table) == []
        assert sim.request_count("/v1/responses/resp_down") == 3
        assert broken.served == 3  # the provider works again from now on
        assert await letters.replay(found) == 1
        rows = await wait_for(lambda: pg_rows(pg_url, pg_table))
        assert [r["key"] for r in rows] == ["resp_down"]
        assert await letters.count() == 0
        await pool.aclose()


async def test_a_dead_letter_keeps_the_providers_own_reason(
    stack, redis_url, signed_callback, caplog
):
    """A fetch the provider refuses (404 for an id it does not know) is a dead letter that
    says what the provider said, not only its status, and so is its log line."""
    settings, _ = stack()
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        assert (await post(base, *signed_callback("resp_unknown"))).status_code == 202
        pool = arq_pool(RedisConnector.from_url(redis_url))
        [letter] = await wait_for(DeadLetters(pool).find)
        await pool.aclose()
    assert letter.keys == ["resp_unknown"]
    said = '(HTTP 404): unexpected status; the provider said: "no such response"'
    assert letter.error.endswith(said)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dead letter")]
    assert line.startswith(f"dead letter {letter.id}: fetch resp_unknown") and line.endswith(said)


async def test_provider_spellings_land_in_nopolls_words(
    stack, redis_url, signed_callback, tmp_path
):
    """``canceled`` lands as ``cancelled`` (a status the results stream can filter on), and
    ``COMPLETED`` as a usable ``completed``."""
    settings, sim = stack()
    sim.add_response("resp_canceled", status="canceled", text=None)
    sim.add_response("resp_upper", status="COMPLETED")
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        for rid in ("resp_canceled", "resp_upper"):
            assert (await post(base, *signed_callback(rid))).status_code == 202

        async def landed():
            rows = jsonl_rows(tmp_path / "results")
            return rows if len(rows) == 2 else None

        rows = await wait_for(landed)
    got = {r["key"]: (r["status"], r["usable"]) for r in rows}
    assert got == {"resp_canceled": ("cancelled", False), "resp_upper": ("completed", True)}


async def test_incomplete_max_output_tokens_with_text_is_usable(
    stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, sim = stack()
    sim.add_response(
        "resp_inc",
        status="incomplete",
        incomplete_reason="max_output_tokens",
        text="partial answer",
    )
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        await post(base, *signed_callback("resp_inc", event_type="response.incomplete"))
        rows = await wait_for(lambda: pg_rows(pg_url, pg_table))
    row = rows[0]
    assert (row["status"], row["usable"], row["incomplete_reason"], row["output_text"]) == (
        "incomplete",
        True,
        "max_output_tokens",
        "partial answer",
    )


async def test_postgres_down_jsonl_written_at_once_postgres_after_recovery(
    stack, redis_url, signed_callback, pg_url, pg_table, tmp_path
):
    proxy = TcpProxy("127.0.0.1", 5432)
    await proxy.up()
    proxied = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    settings, sim = stack(pg_port_url=proxied)
    sim.add_response("resp_pgdown", text="kept")
    try:
        async with (
            running_api(settings, redis_url) as (base, _),
            running_worker(settings, redis_url),
        ):
            await wait_for(lambda: worker_started(redis_url))  # sinks opened, Postgres up
            await proxy.down()
            assert (await post(base, *signed_callback("resp_pgdown"))).status_code == 202
            files = await wait_for(lambda: asyncio.to_thread(jsonl_rows, tmp_path / "results"))
            assert [f["key"] for f in files] == ["resp_pgdown"]
            await wait_for(lambda: delivery_tries_at_least(redis_url, 3))  # Postgres failed
            assert await pg_rows(pg_url, pg_table) == []
            await proxy.up()
            rows = await wait_for(lambda: pg_rows(pg_url, pg_table), timeout=30)
            assert [r["key"] for r in rows] == ["resp_pgdown"]
            # JSONL was not written again by the Postgres retries
            assert len(jsonl_rows(tmp_path / "results")) == 1
    finally:
        await proxy.down()
    assert sim.request_count("/v1/responses/") == 1


async def test_sink_failing_every_try_is_dead_lettered_then_replayed(
    stack, redis_url, signed_callback, pg_url, pg_table, tmp_path
):
    proxy = TcpProxy("127.0.0.1", 5432)
    proxied = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    settings, sim = stack(
        pg_port_url=proxied, sink_retry={"max_tries": 3, "base_delay_s": 0.05, "max_delay_s": 0.1}
    )
    sim.add_response("resp_dl")
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        await post(base, *signed_callback("resp_dl"))
        pool = arq_pool(RedisConnector.from_url(redis_url))
        letters = DeadLetters(pool)
        found = await wait_for(lambda: letters.find(sink="warehouse"))
        assert found[0].keys == ["resp_dl"] and found[0].attempts == 3
        assert await letters.find(sink="files") == []
        await proxy.up()
        try:
            await letters.replay(found)
            rows = await wait_for(lambda: pg_rows(pg_url, pg_table))
            assert [r["key"] for r in rows] == ["resp_dl"]
        finally:
            await proxy.down()
            await pool.aclose()
    assert len(jsonl_rows(tmp_path / "results")) == 1


async def test_a_failed_event_after_completed_keeps_the_completed_row(
    stack, redis_url, signed_callback, pg_url, pg_table
):
    """Out of order: ``response.failed`` arrives after ``response.completed`` for the same
    id (a new webhook-id). nopoll stores the provider's object, never the event's claim:
    the second fetch finds the same completed object, and the row stays completed."""
    settings, sim = stack()
    sim.add_response("resp_order", text="the answer")
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        body, headers = signed_callback("resp_order", event_type="response.completed")
        assert (await post(base, body, headers)).status_code == 202

        async def completed():
            rows = await pg_rows(pg_url, pg_table)
            return rows if rows and rows[0]["status"] == "completed" else None

        await wait_for(completed)
        late, late_headers = signed_callback("resp_order", event_type="response.failed")
        assert (await post(base, late, late_headers)).status_code == 202

        async def refetched():
            return sim.request_count("/v1/responses/resp_order") >= 2 or None

        await wait_for(refetched)
        await asyncio.sleep(0.5)  # the second fetch's write has landed
        rows = await pg_rows(pg_url, pg_table)
    assert len(rows) == 1
    assert (rows[0]["status"], rows[0]["output_text"]) == ("completed", "the answer")
