"""Results without callbacks: watches polled by real workers against the provider
simulator, landing in real Postgres; rate limits counted at the simulator."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import pytest
from redis.asyncio import Redis

from receiver.queue.deadletter import DeadLetters
from receiver.watches.store import register_many
from tests.e2e.helpers import (
    NOPOLL,
    jsonl_rows,
    pg_rows,
    post,
    sql_sink,
    wait_for,
    wait_pg_rows,
    write_config,
)
from tests.e2e.losses import letters
from tests.limited_provider import max_in_any_second
from tests.servers import running_api, running_worker

pytestmark = pytest.mark.slow


async def test_a_watched_response_that_completes_later_lands_once_without_event_id(
    watch_stack, redis_url, pg_url, pg_table, tmp_path
):
    settings, sim, store = watch_stack()
    sim.add_response("resp_later", pending_until=time.time() + 3, text="done at last")
    assert await store.register("sim", "response", "resp_later", first_poll_in_s=0.3)
    async with running_worker(settings, redis_url):
        [row] = await wait_pg_rows(pg_url, pg_table, 1)
        polls_at_landing = sim.request_count("/v1/responses/resp_later")
        await asyncio.sleep(2.5)  # nothing more happens to a landed watch
    assert (row["key"], row["status"], row["output_text"]) == (
        "resp_later",
        "completed",
        "done at last",
    )
    assert row["event_id"] is None
    assert 3 <= polls_at_landing <= 12  # backing off from 0.3 s up to 1 s over ~3 s
    assert sim.request_count("/v1/responses/resp_later") == polls_at_landing
    watch = await store.get("sim", "response", "resp_later")
    assert watch is not None and watch.state == "landed"
    assert [r["key"] for r in jsonl_rows(tmp_path / "out")] == ["resp_later"]


async def test_1000_watches_from_two_workers_never_exceed_the_rate_limit(
    watch_stack, redis_url, procs, tmp_path, pg_url, pg_table
):
    _, sim, store = watch_stack(rate_limit_rps=50, first_poll_s=1.0, max_interval_s=2.0)
    until = time.time() + 6
    ids = [f"resp_rate_{i:04d}" for i in range(1000)]
    for rid in ids:
        sim.add_response(rid, pending_until=until)
    config = write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        sinks=sql_sink(pg_url, pg_table),
        provider="    api_key: sk-test-not-a-real-key\n"
        "    watch: {rate_limit_rps: 50, first_poll_s: 1, max_interval_s: 2}\n",
    )
    for _ in range(2):
        procs.start("worker", "--config", str(config))
    added = await store.register_all("sim", "response", ids, first_poll_in_s=1.0)
    assert all(added)
    rows = len(await wait_pg_rows(pg_url, pg_table, 1000, timeout=120, interval=0.5))
    assert rows == 1000
    stamps = sorted(sim.request_times("/v1/responses/"))
    assert max_in_any_second(stamps) <= 50, procs.logs()[-3000:]
    assert len(stamps) >= 1000


def _watched_config(tmp_path, sim, redis_url, pg_url, pg_table):
    """A config file whose provider ``sim`` is polled (no webhook secrets) into Postgres."""
    return write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        sinks=sql_sink(pg_url, pg_table),
        provider="    watch: {first_poll_s: 0.3, max_interval_s: 1}\n",
    )


async def test_a_callback_for_a_watched_id_lands_it_once_and_ends_the_watch(
    watch_stack, redis_url, signed_callback, pg_url, pg_table, tmp_path
):
    settings, sim, store = watch_stack(secrets=True, first_poll_s=2.0, max_interval_s=3.0)
    sim.add_response("resp_cb")
    await store.register("sim", "response", "resp_cb", first_poll_in_s=2.0)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        assert (await post(base, *signed_callback("resp_cb"))).status_code == 202
        await wait_pg_rows(pg_url, pg_table, 1)
        await asyncio.sleep(3)  # past the watch's first poll time: no poll comes
    assert sim.request_count("/v1/responses/resp_cb") == 1  # the callback's fetch only
    watch = await store.get("sim", "response", "resp_cb")
    assert watch is not None and watch.state == "landed"
    assert [r["key"] for r in jsonl_rows(tmp_path / "out")] == ["resp_cb"]  # one delivery


async def test_expect_callback_ids_are_polled_only_when_no_callback_came_in_time(
    watch_stack, redis_url, signed_callback, pg_url, pg_table, tmp_path
):
    settings, sim, store = watch_stack(secrets=True, reconcile_after_s=3.0)
    sim.add_response("resp_called")
    sim.add_response("resp_lost_callback")
    registered = time.time()
    result = await register_many(
        store,
        "sim",
        "response",
        ["resp_called", "resp_lost_callback"],
        first_poll_s=settings.providers["sim"].watch.first_poll_s,
        reconcile_after_s=settings.providers["sim"].watch.reconcile_after_s,
        expect_callback=True,
    )
    assert (result.watching, result.already) == (2, 0)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        assert (await post(base, *signed_callback("resp_called"))).status_code == 202
        rows = await wait_pg_rows(pg_url, pg_table, 2)
        await asyncio.sleep(1.5)  # a landed watch is never polled again
    by_key = {row["key"]: row for row in rows}
    assert by_key["resp_called"]["event_id"] is not None  # landed by its callback
    assert by_key["resp_lost_callback"]["event_id"] is None  # landed by the safety-net poll
    assert sim.request_count("/v1/responses/resp_called") == 1  # the callback's fetch only
    [poll] = sim.request_times("/v1/responses/resp_lost_callback")
    assert poll >= registered + 3.0 - 0.1  # not polled before reconcile_after_s
    assert sorted(r["key"] for r in jsonl_rows(tmp_path / "out")) == [
        "resp_called",
        "resp_lost_callback",
    ]


async def test_a_callback_after_the_poll_landed_it_delivers_nothing_more(
    watch_stack, redis_url, signed_callback, pg_url, pg_table, tmp_path
):
    settings, sim, store = watch_stack(secrets=True)
    sim.add_response("resp_polled")
    await store.register("sim", "response", "resp_polled", first_poll_in_s=0)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        await wait_pg_rows(pg_url, pg_table, 1)
        assert (await post(base, *signed_callback("resp_polled"))).status_code == 202

        async def settled():
            client = Redis.from_url(redis_url)
            try:
                return not await client.zcard("nopoll:jobs")
            finally:
                await client.aclose()

        await wait_for(settled, timeout=20)
    assert sim.request_count("/v1/responses/resp_polled") == 1  # the poll's GET only
    assert [r["key"] for r in jsonl_rows(tmp_path / "out")] == ["resp_polled"]


async def test_an_expired_watch_is_a_dead_letter_that_says_so(
    watch_stack, redis_url, pg_url, pg_table
):
    settings, sim, store = watch_stack(expire_after_s=2.0)
    sim.add_response("resp_never", pending_times=10_000, pending_status="queued")
    await store.register("sim", "response", "resp_never", first_poll_in_s=0)
    async with running_worker(settings, redis_url):

        async def one_letter():
            return await letters(redis_url, sink="watch") or None

        [letter] = await wait_for(one_letter, timeout=30)
    assert letter.function == "fetch_response" and letter.keys == ["resp_never"]
    assert letter.error.startswith("expired: still queued after")
    watch = await store.get("sim", "response", "resp_never")
    assert watch is not None and watch.state == "expired"
    assert await pg_rows(pg_url, pg_table) == []


async def test_replaying_an_expired_batch_watch_lands_it_and_ends_the_watch_landed(
    watch_stack, redis_url, pg_url, pg_table
):
    settings, sim, store = watch_stack("sference", expire_after_s=2.0)
    batch = sim.add_batch("sference", "b_late", 120, pending_until=time.time() + 3600)
    await store.register("sim", "batch", "b_late", first_poll_in_s=0)
    async with running_worker(settings, redis_url):

        async def one_letter():
            return await letters(redis_url, sink="watch") or None

        [letter] = await wait_for(one_letter, timeout=30)
        assert letter.function == "fetch_batch" and letter.keys == ["b_late"]
        watch = await store.get("sim", "batch", "b_late")
        assert watch is not None and watch.state == "expired"
        batch.pending_until = None  # the batch finished after all: replay the letter
        pool = Redis.from_url(redis_url)
        try:
            assert await DeadLetters(pool).replay([letter]) == 1
        finally:
            await pool.aclose()
        rows = await wait_pg_rows(pg_url, pg_table, 121)

        async def landed():
            w = await store.get("sim", "batch", "b_late")
            return w if w is not None and w.state == "landed" else None

        await wait_for(landed, timeout=20)
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 120
    assert (await store.counts("sim"))["expired"] == 0


@pytest.mark.parametrize(
    ("dialect", "options"),
    [
        ("openai", {"pending_status": "finalizing"}),
        ("sference", {}),  # pending, then running
        ("sail", {"shape": "guide"}),  # in_progress, then completed
        ("valar", {}),  # no status: every row settles
    ],
    ids=["openai", "sference", "sail", "valar"],
)
async def test_a_watched_batch_lands_every_row_then_its_summary(
    watch_stack, redis_url, pg_url, pg_table, dialect, options
):
    settings, sim, store = watch_stack(dialect)
    sim.add_batch(dialect, f"b_{dialect}", 250, pending_until=time.time() + 2, **options)
    await store.register("sim", "batch", f"b_{dialect}", first_poll_in_s=0.3)
    async with running_worker(settings, redis_url):
        rows = await wait_pg_rows(pg_url, pg_table, 251)
    summary = next(r for r in rows if r["kind"] == "batch")
    assert summary["status"] == "completed" and summary["event_id"] is None
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 250
    watch = await store.get("sim", "batch", f"b_{dialect}")
    assert watch is not None and watch.state == "landed"


async def test_a_watched_sail_batch_larger_than_the_answer_cap_lands_once(
    watch_stack, redis_url, pg_url, pg_table
):
    """Sail's inline results may reach ~1 GiB, over any cap on an answer read whole: the
    watch's poll streams the object and stops where the results begin (it needs only to
    know the batch is over), and the batch job reads them once, streamed."""
    settings, sim, store = watch_stack("sail")
    settings = settings.model_copy(
        update={"http": settings.http.model_copy(update={"max_response_bytes": 2 << 20})}
    )
    sim.add_batch(
        "sail",
        "b_big",
        120,
        shape="guide",
        body_bytes=60_000,
        pending_until=time.time() + 1.5,
        pending_status="in_progress",
    )  # ~7 MB of inline results: over three times the cap
    await store.register("sim", "batch", "b_big", first_poll_in_s=0.3)
    async with running_worker(settings, redis_url):
        rows = await wait_pg_rows(pg_url, pg_table, 121, timeout=60)
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 120
    watch = await store.get("sim", "batch", "b_big")
    assert watch is not None and watch.state == "landed"
    assert await letters(redis_url) == []


async def test_sigkill_of_the_worker_mid_poll_and_a_restart_lose_no_watch(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    sim = provider_sim()
    ids = [f"resp_kill_{i:02d}" for i in range(20)]
    for rid in ids:
        sim.add_response(rid, delay_s=3.0, delay_times=1)  # the first GET hangs for 3 s
    config = _watched_config(tmp_path, sim, redis_url, pg_url, pg_table)
    worker = procs.start("worker", "--config", str(config))
    watch = await asyncio.to_thread(
        subprocess.run,
        [str(NOPOLL), "watch", "--config", str(config), "sim", "response", "--from", "-"],
        input="\n".join(ids) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=procs.env,
    )
    assert watch.returncode == 0 and "watching 20 new response id(s) of sim" in watch.stdout

    async def polling():
        return sim.request_count("/v1/responses/") >= 10

    await wait_for(polling, timeout=30)
    worker.send_signal(signal.SIGKILL)  # mid-poll: GETs in flight, watches leased
    worker.wait(10)
    procs.start("worker", "--config", str(config))  # the restart: the leases run out
    rows = len(await wait_pg_rows(pg_url, pg_table, 20, timeout=90, interval=0.5))
    assert rows == 20
    keys = sorted(r["key"] for r in await pg_rows(pg_url, pg_table))
    assert keys == ids


async def test_nopoll_watch_waits_with_a_summary_and_reports_invalid_ids(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    sim = provider_sim()
    for rid in ("resp_a", "resp_b"):
        sim.add_response(rid, pending_until=time.time() + 1.5)
    config = _watched_config(tmp_path, sim, redis_url, pg_url, pg_table)
    procs.start("worker", "--config", str(config))
    result = await asyncio.to_thread(
        subprocess.run,
        [
            str(NOPOLL),
            "watch",
            "--config",
            str(config),
            "sim",
            "response",
            "resp_a",
            "resp_b",
            "bad id",
            "--wait",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**procs.env, "COLUMNS": "120"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipped 'bad id'" in result.stderr
    assert "2 landed, 0 expired, 0 still pending" in result.stdout
    nothing = await asyncio.to_thread(
        subprocess.run,
        [str(NOPOLL), "watch", "--config", str(config), "sim", "response", "bad id"],
        capture_output=True,
        text=True,
        timeout=60,
        env=procs.env,
    )
    assert nothing.returncode == 2  # nothing could be registered
