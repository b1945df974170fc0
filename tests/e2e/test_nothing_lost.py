"""Loss paths found by trying nopoll from the outside, each pinned against real servers:
replayed batch dead letters, unfinished provider objects, job deadlines, jobs arq gives
up on, a changed chunk size, a dead chunk's summary and a refused row (the batch lease:
test_batch_leases.py)."""

from __future__ import annotations

import pytest

from nopoll.envelope import now_rfc3339
from nopoll.exceptions import TransientProviderError
from receiver.queue._arq import JOB_KEY, RETRY_KEY, arq_pool
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import (
    BATCHES_QUEUE,
    FETCH_RESPONSE,
    JOBS_QUEUE,
    QueuedJob,
    put_job,
    response_job_id,
)
from receiver.redis import RedisConnector
from tests.dead_letters import keep_letter
from tests.e2e.helpers import jsonl_rows, pg_rows, post, queues_empty, wait_for
from tests.e2e.losses import (
    batch_done,
    letters,
    replay_all,
    run_batch,
    serving,
    summary_rows,
)
from tests.servers import running_api, running_worker
from tests.subscriber import Subscriber

# --- replaying a batch dead letter --------------------------------------------------------


async def test_replayed_batch_dead_letter_runs_on_the_batch_queue(
    loss_stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, sim = loss_stack("sference")
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        # the provider does not know the batch yet: a permanent 404, kept as a dead letter
        r = await post(base, *signed_callback("batch_late", event_type="batch.completed"))
        assert r.status_code == 202

        async def one_letter() -> list | None:
            found = await letters(redis_url, sink="fetch")
            return found or None

        [letter] = await wait_for(one_letter, timeout=30)
        assert letter.function == "fetch_batch" and "HTTP 404" in letter.error
        sim.add_batch("sference", "batch_late", 450, failed_every=7)
        assert await replay_all(redis_url) == 1
        rows = await summary_rows(pg_url, pg_table, "batch_late")
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 450
    assert await letters(redis_url) == []


async def test_a_letter_of_an_unknown_function_is_kept_not_queued(redis_url, redis_sync_client):
    pool = arq_pool(RedisConnector.from_url(redis_url))
    try:
        store = DeadLetters(pool)
        await keep_letter(store, "", kwargs={"job_id": "deliver:gone"}, error="arq gave up")
        found = await store.find()
        assert await store.replay(found) == 0
        assert len(await store.find()) == 1  # still kept, still listed
    finally:
        await pool.aclose()
    assert redis_sync_client.zcard(JOBS_QUEUE) == 0 == redis_sync_client.zcard(BATCHES_QUEUE)


# --- unfinished provider objects ----------------------------------------------------------


async def test_an_in_progress_response_is_fetched_again_not_stored(
    loss_stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, sim = loss_stack()
    sim.add_response("resp_eventual", pending_times=2, text="finally")
    async with serving(settings, redis_url, signed_callback("resp_eventual")):
        rows = await wait_for(lambda: pg_rows(pg_url, pg_table), timeout=30)
    assert [(r["status"], r["output_text"]) for r in rows] == [("completed", "finally")]
    assert sim.request_count("/v1/responses/resp_eventual") == 3


async def test_a_response_that_never_finishes_is_a_dead_letter_naming_its_status(
    loss_stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, sim = loss_stack()
    sim.add_response("resp_stuck", pending_times=1000, pending_status="queued")
    async with serving(settings, redis_url, signed_callback("resp_stuck")):

        async def one_letter() -> list | None:
            return await letters(redis_url, key="resp_stuck") or None

        [letter] = await wait_for(one_letter, timeout=30)
    assert "not finished yet (status 'queued')" in letter.error
    assert await pg_rows(pg_url, pg_table) == []


async def test_a_finalizing_openai_batch_is_retried_until_it_is_terminal(
    loss_stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, sim = loss_stack("openai")
    # finalizing, output_file_id null, twice; then completed with its files
    sim.add_batch("openai", "batch_fin", 500, failed_every=9, pending_times=2)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        r = await post(base, *signed_callback("batch_fin", event_type="batch.completed"))
        assert r.status_code == 202
        rows = await summary_rows(pg_url, pg_table, "batch_fin")
    summary = next(r for r in rows if r["kind"] == "batch")
    assert summary["status"] == "completed"
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 500
    assert sim.request_count("/v1/batches/batch_fin") == 3


# --- the job deadline ---------------------------------------------------------------------


async def test_a_slow_fetch_plus_a_slow_sink_past_the_job_time_limit_is_retried(
    loss_stack, redis_url, signed_callback, webhook_secret
):
    subscriber = await Subscriber(webhook_secret, delay_s=2.2).start()
    try:
        settings, sim = loss_stack(
            sinks={
                "hook": {
                    "type": "http",
                    "url": subscriber.url(),
                    "secret": webhook_secret,
                    "timeout_s": 2.6,
                }
            },
            worker={"poll_delay_s": 0.01, "response_job_timeout_s": 4, "shutdown_wait_s": 2},
            http={"connect_timeout_s": 1, "read_timeout_s": 2.5},
        )
        # try 1: a 2 s fetch, then the sink's 2.2 s: past the 4 s limit; try 2: 2.2 s
        sim.add_response("resp_late", delay_s=2.0, delay_times=1)
        async with (
            running_api(settings, redis_url) as (base, _),
            running_worker(settings, redis_url),
        ):
            r = await post(base, *signed_callback("resp_late"))
            assert r.status_code == 202

            async def delivered_twice_and_done() -> bool:
                return len(subscriber.deliveries) >= 2 and await queues_empty(redis_url)

            await wait_for(delivered_twice_and_done, timeout=30)
    finally:
        await subscriber.stop()
    assert {d.payload["key"] for d in subscriber.deliveries} == {"resp_late"}
    assert await letters(redis_url) == []


def test_a_sink_timeout_as_long_as_the_job_is_refused_at_start_up(make_settings):
    from nopoll.exceptions import ConfigError

    with pytest.raises(ConfigError, match=r"sinks\.files\.timeout_s \(60 s\) must be below"):
        make_settings(
            sinks={"files": {"type": "jsonl", "dir": "/tmp/x", "timeout_s": 60}},
            worker={"response_job_timeout_s": 60},
        )
    # unset timeouts follow a short job time limit down instead of contradicting it
    settings = make_settings(worker={"response_job_timeout_s": 6}, http={})
    assert settings.sinks["files"].timeout_s == 3 and settings.http.read_timeout_s == 3


# --- what arq would fail for good ---------------------------------------------------------


@pytest.mark.parametrize("fault", ["expired", "max_tries"])
async def test_a_job_arq_gives_up_on_becomes_a_dead_letter_and_replays(
    loss_stack, redis_url, redis_sync_client, pg_url, pg_table, fault
):
    settings, sim = loss_stack()
    sim.add_response("resp_arq", text="rescued")
    job_id = response_job_id("sim", "resp_arq")
    kwargs = {"provider": "sim", "response_id": "resp_arq", "received_at": now_rfc3339()}
    pool = arq_pool(RedisConnector.from_url(redis_url))
    try:
        await put_job(pool, QueuedJob(FETCH_RESPONSE, job_id, kwargs), expiry_ms=60_000)
    finally:
        await pool.aclose()
    if fault == "expired":
        redis_sync_client.delete(JOB_KEY + job_id)  # the payload is gone
    else:
        redis_sync_client.set(RETRY_KEY + job_id, 1000)  # far past any try limit
    async with running_worker(settings, redis_url):

        async def one_letter() -> list | None:
            return await letters(redis_url, key="resp_arq") or None

        [letter] = await wait_for(one_letter, timeout=20)
        assert letter.function == "fetch_response"
        assert ("expired" if fault == "expired" else "retries exceeded") in letter.error
        assert await replay_all(redis_url) == 1
        rows = await wait_for(lambda: pg_rows(pg_url, pg_table), timeout=20)
    assert [r["output_text"] for r in rows] == ["rescued"]


# --- a chunk size changed between two runs of a batch --------------------------------------


@pytest.mark.parametrize("second_chunk_size", [300, 70])
async def test_a_resume_after_the_chunk_size_changed_writes_every_row_exactly_once(
    loss_stack, redis_url, redis_sync_client, tmp_path, second_chunk_size
):
    files = {"files": {"type": "jsonl", "dir": str(tmp_path / "out")}}
    settings, sim = loss_stack("valar", sinks=files)
    # row 650 (chunk 3 at 200 rows per chunk) fails every try of the first run
    batch = sim.add_batch("valar", "batch_resize", 1000, row_failures={"row-000650": 2})
    with pytest.raises(TransientProviderError):
        await run_batch(settings, redis_url, "batch_resize")
    assert redis_sync_client.hget("nopoll:batch:sim:batch_resize", "c:files") == b"2"

    resized = settings.model_copy(
        update={"batch": settings.batch.model_copy(update={"chunk_size": second_chunk_size})}
    )
    outcome = await run_batch(resized, redis_url, "batch_resize")
    assert outcome.chunks_skipped == 3  # the first run's three 200-row chunks
    keys = [r["key"] for r in jsonl_rows(tmp_path / "out") if r["kind"] == "batch_row"]
    assert len(keys) == len(set(keys)) == batch.n_rows


@pytest.mark.parametrize(
    ("dialect", "options"),
    [("openai", {}), ("sference", {}), ("sail", {"shape": "guide"})],  # Sail: inline results
    ids=["openai", "sference", "sail"],
)
async def test_a_batch_stopped_mid_way_resumes_byte_bounded_chunks_without_loss_or_repeat(
    loss_stack, redis_url, redis_sync_client, tmp_path, dialect, options
):
    from nopoll.exceptions import ProviderError
    from receiver.demo.answers import Oversize

    files = {"files": {"type": "jsonl", "dir": str(tmp_path / "out")}}
    # ~650-byte rows (failed ones smaller) in chunks of 3,000 bytes: a few rows each, cut
    # by bytes at irregular places, never by the 200 rows
    bounded = {"chunk_size": 200, "chunk_bytes": 3000, "lease_s": 2, "sink_attempts": 2}
    settings, sim = loss_stack(
        dialect, sinks=files, batch=bounded, http={"max_line_bytes": 64 * 1024}
    )
    batch = sim.add_batch(
        dialect, "batch_bytes", 400, failed_every=7, body_bytes=500, shuffled=False, **options
    )
    batch.oversize, batch.oversize_at = Oversize("padded", 3 * 1024 * 1024), 250
    with pytest.raises(ProviderError):  # row 250 is over max_line_bytes: the run stops there
        await run_batch(settings, redis_url, "batch_bytes")
    state_key = "nopoll:batch:sim:batch_bytes"
    committed = int(redis_sync_client.hget(state_key, "c:files"))
    assert redis_sync_client.hget(state_key, "cs") == b"200/3000"
    first = [r["key"] for r in jsonl_rows(tmp_path / "out") if r["kind"] == "batch_row"]
    assert 0 < len(first) < 250 and committed > 10  # stopped mid-way, after many chunks

    # the next run is told other bounds; the batch keeps its first run's
    batch.oversize = None
    changed = settings.model_copy(
        update={"batch": settings.batch.model_copy(update={"chunk_size": 7, "chunk_bytes": 0})}
    )
    outcome = await run_batch(changed, redis_url, "batch_bytes")
    assert outcome.chunks_skipped == committed + 1
    keys = [r["key"] for r in jsonl_rows(tmp_path / "out") if r["kind"] == "batch_row"]
    assert len(keys) == len(set(keys)) == batch.n_rows


# --- a dead chunk holds its batch summary back ----------------------------------------------


async def test_a_dead_lettered_chunk_keeps_the_summary_parked_until_its_replay(
    loss_stack, redis_url, signed_callback, webhook_secret
):
    subscriber = await Subscriber(webhook_secret, status=400).start()  # refuses everything
    try:
        sinks = {"hook": {"type": "http", "url": subscriber.url(), "secret": webhook_secret}}
        settings, sim = loss_stack("sference", sinks=sinks)
        sim.add_batch("sference", "batch_held", 400)
        async with (
            running_api(settings, redis_url) as (base, _),
            running_worker(settings, redis_url),
        ):
            r = await post(base, *signed_callback("batch_held", event_type="batch.completed"))
            assert r.status_code == 202

            async def two_letters() -> list | None:
                found = await letters(redis_url, sink="hook")
                return found if len(found) == 2 else None

            await wait_for(two_letters, timeout=30)
            await wait_for(lambda: batch_done(redis_url, "batch_held"), timeout=30)
            accepted = [d for d in subscriber.deliveries if d.verified]
            kinds = {e["kind"] for d in accepted for e in _envelopes(d.payload)}
            assert "batch" not in kinds  # no summary while its rows are dead letters

            subscriber.status = 200
            assert await replay_all(redis_url) == 2

            async def summary_sent() -> bool:
                return any(
                    e["kind"] == "batch"
                    for d in subscriber.deliveries[len(accepted) :]
                    for e in _envelopes(d.payload)
                )

            await wait_for(summary_sent, timeout=30)
    finally:
        await subscriber.stop()
    after = [e for d in subscriber.deliveries[len(accepted) :] for e in _envelopes(d.payload)]
    rows = [e["key"] for e in after if e["kind"] == "batch_row"]
    assert len(set(rows)) == 400
    assert after[-1]["kind"] == "batch"  # the summary came after every row


def _envelopes(payload) -> list[dict]:
    return payload if isinstance(payload, list) else [payload]


# --- one bad row fails alone, end to end -----------------------------------------------------


async def test_a_row_postgres_refuses_is_a_dead_letter_alone_and_the_rest_land(
    loss_stack, redis_url, signed_callback, pg_url, pg_table, tmp_path
):
    sinks = {
        "warehouse": {"type": "sql", "url": pg_url, "table": pg_table},
        "files": {"type": "jsonl", "dir": str(tmp_path / "out")},
    }
    settings, sim = loss_stack(sinks=sinks)
    sim.add_response("resp_nul", text="before\x00after")
    huge = sim.add_response("resp_huge")
    huge.body["usage"]["input_tokens"] = 2**40  # beyond the INTEGER column
    for i in range(5):
        sim.add_response(f"resp_ok_{i}")
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        ids = ["resp_nul", "resp_huge", *(f"resp_ok_{i}" for i in range(5))]
        for rid in ids:
            assert (await post(base, *signed_callback(rid))).status_code == 202

        async def settled() -> list | None:
            found = await letters(redis_url)
            rows = await pg_rows(pg_url, pg_table)
            return found if found and len(rows) == 6 else None

        [letter] = await wait_for(settled, timeout=30)
    rows = {r["key"]: r for r in await pg_rows(pg_url, pg_table)}
    assert rows["resp_nul"]["output_text"] == "before\ufffdafter"
    assert "resp_huge" not in rows
    assert letter.sink == "warehouse" and letter.keys == ["resp_huge"]
    assert "refused 1 row" in letter.error
    # the other sink took every result, the refused one included
    assert {r["key"] for r in jsonl_rows(tmp_path / "out")} == set(ids)


async def test_a_refused_batch_row_holds_the_summary_and_fails_no_other_row(
    loss_stack, redis_url, signed_callback, pg_url, pg_table
):
    settings, sim = loss_stack("valar")
    batch = sim.add_batch("valar", "batch_bad_row", 600)
    plain = batch.response_body

    def body(i: int) -> dict:
        out = plain(i)
        if i == 321:
            out["usage"]["output_tokens"] = 2**40
        return out

    batch.response_body = body  # type: ignore[method-assign]
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        r = await post(base, *signed_callback("batch_bad_row", event_type="batch.completed"))
        assert r.status_code == 202

        async def one_letter() -> list | None:
            return await letters(redis_url, sink="warehouse") or None

        [letter] = await wait_for(one_letter, timeout=30)
        await wait_for(lambda: batch_done(redis_url, "batch_bad_row"), timeout=30)
        rows = await pg_rows(pg_url, pg_table)
    assert letter.keys == ["batch_bad_row/row-000321"]
    assert len(rows) == 599 and all(r["kind"] == "batch_row" for r in rows)  # no summary yet
