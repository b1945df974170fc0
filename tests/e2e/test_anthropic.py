"""The ``anthropic`` dialect end to end: Message Batches watched by a real worker against
the provider simulator, through real Redis into real Postgres; ``nopoll submit --batch``
with both line forms."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from redis.asyncio import Redis

from nopoll.exceptions import TransientProviderError
from receiver.watches.store import WatchStore
from tests.e2e.helpers import (
    jsonl_rows,
    nopoll_submit,
    pg_rows,
    sql_sink,
    wait_for,
    wait_pg_rows,
    write_config,
)
from tests.e2e.losses import letters, run_batch
from tests.servers import running_worker

pytestmark = pytest.mark.slow

KEY = "sk-test-not-a-real-key"
FAST = {"first_poll_s": 0.2, "max_interval_s": 0.4}


@pytest.fixture
def anthropic_stack(watch_stack):
    """Factory: ``watch_stack`` with provider ``sim`` in the anthropic dialect, polled
    quickly; keyword arguments set more of the provider's fields."""
    return lambda **provider: watch_stack("anthropic", provider=provider, **FAST)


async def test_a_batch_in_progress_then_canceling_then_ended_lands_every_row_once(
    anthropic_stack, redis_url, pg_url, pg_table, tmp_path
):
    settings, sim, store = anthropic_stack()
    batch = sim.add_batch(
        "anthropic",
        "msgbatch_watch1",
        250,
        in_progress_polls=2,
        cancel_after_polls=2,
        canceling_polls=2,
        canceled_every=5,
        errored_every=7,
        expired_every=11,
        max_tokens_every=13,
        results_fail_times=1,
        results_fail_status=429,
        retry_after=0.3,
    )
    await store.register("sim", "batch", "msgbatch_watch1", first_poll_in_s=0.2)
    async with running_worker(settings, redis_url):
        rows = await wait_pg_rows(pg_url, pg_table, 251)
        await asyncio.sleep(1.0)  # nothing more arrives
        rows = await pg_rows(pg_url, pg_table)
    assert batch.canceling_served == 2  # it was seen canceling, then ended
    results = "/v1/messages/batches/msgbatch_watch1/results"
    assert sim.request_count(results) == 2  # 429 first, then the stream
    by_key = {r["key"]: r for r in rows if r["kind"] == "batch_row"}
    assert len(by_key) == 250 == len([r for r in rows if r["kind"] == "batch_row"])
    assert set(by_key) == {f"msgbatch_watch1/row-{i:06d}" for i in range(250)}
    files = [r for r in jsonl_rows(tmp_path / "out") if r["kind"] == "batch_row"]
    assert sorted(r["key"] for r in files) == sorted(by_key)  # once in the files sink too
    for i in range(250):
        row = by_key[f"msgbatch_watch1/row-{i:06d}"]
        kind = batch.result_type(i)
        expected = {
            "succeeded": "completed",
            "errored": "failed",
            "canceled": "cancelled",
            "expired": "expired",
        }[kind]
        if kind == "succeeded" and i % 13 == 12:
            expected = "incomplete"
        assert row["status"] == expected, (i, kind, row["status"])
        if kind == "succeeded":
            assert row["output_text"] == f"answer {i}" and row["usable"] is True
            assert (row["input_tokens"], row["output_tokens"]) == (12, 4)
            assert (
                row["model"] == "claude-sim-1" and row["response_id"] == f"msg_msgbatch_watch1_{i}"
            )
        if kind == "errored":
            error = row["error"] if isinstance(row["error"], dict) else orjson.loads(row["error"])
            assert error == {"code": "invalid_request_error", "message": f"row {i}: bad params"}
    [summary] = [r for r in rows if r["kind"] == "batch"]
    # a cancel was initiated: the summary says cancelled (not usable), as OpenAI's
    # batch.cancelled does, though the Message Batch itself only says "ended"
    assert (summary["status"], summary["usable"]) == ("cancelled", False)
    metadata = summary["metadata"]
    metadata = metadata if isinstance(metadata, dict) else orjson.loads(metadata)
    assert metadata["request_counts"] == batch.counts(True)
    assert sum(metadata["rows_by_status"].values()) == 250
    watch = await store.get("sim", "batch", "msgbatch_watch1")
    assert watch is not None and watch.state == "landed"


async def test_overloaded_polls_and_results_and_the_x_api_key_form_still_land(
    anthropic_stack, redis_url, pg_url, pg_table
):
    settings, sim, store = anthropic_stack(api_version="2023-06-01")
    sim.add_batch(
        "anthropic",
        "msgbatch_storm",
        40,
        fail_times=3,
        fail_status=529,
        results_fail_times=3,
        results_fail_status=529,
        retry_after=0.2,
    )
    await store.register("sim", "batch", "msgbatch_storm", first_poll_in_s=0.2)
    async with running_worker(settings, redis_url):
        rows = await wait_pg_rows(pg_url, pg_table, 41)
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 40
    # 529 overloaded is retried like a 429, on the batch object and on the results
    assert sim.request_count("/v1/messages/batches/msgbatch_storm/results") == 4
    # the simulator refuses a Bearer token with 2023-06-01: the key went as x-api-key
    assert sim.request_count("/v1/messages/batches/msgbatch_storm") >= 4


async def test_a_batch_resumed_mid_stream_lands_every_row_though_each_download_reorders(
    anthropic_stack, redis_url, redis_sync_client, pg_url, pg_table, tmp_path
):
    """The API promises no order of results, not even from one download to the next: a
    resumed run must not skip the chunks committed before by their position in the stream
    (in the second download those positions hold other rows, some never stored)."""
    settings, sim, _ = anthropic_stack()
    n = 1000
    # the first download breaks off at row 450, in its fifth 100-row chunk
    batch = sim.add_batch(
        "anthropic", "msgbatch_resume", n, errored_every=7, results_break_after=450
    )
    assert batch.order(1)[:400] != batch.order(2)[:400]  # each download has its own order
    with pytest.raises(TransientProviderError, match="stream broke"):
        await run_batch(settings, redis_url, batch.batch_id)
    # the first run committed its four whole chunks (rows 0-399 of the first download)
    state = f"nopoll:batch:sim:{batch.batch_id}"
    assert redis_sync_client.hget(state, "c:warehouse") == b"3"

    outcome = await run_batch(settings, redis_url, batch.batch_id)
    assert batch.results_served == 2
    assert (outcome.chunks_skipped, outcome.rows) == (0, n)  # rewritten from the first row
    rows = await pg_rows(pg_url, pg_table)
    keys = [r["key"] for r in rows if r["kind"] == "batch_row"]
    expected = {f"{batch.batch_id}/row-{i:06d}" for i in range(n)}
    missing = sorted(expected - set(keys))
    assert not missing, f"{len(missing)} of {n} rows never stored, e.g. {missing[:3]}"
    assert len(keys) == len(set(keys)) == n  # the sql sink overwrote the rewritten rows
    files = {r["key"] for r in jsonl_rows(tmp_path / "out") if r["kind"] == "batch_row"}
    assert files == expected  # at least once in the files sink
    [summary] = [r for r in rows if r["kind"] == "batch"]
    metadata = summary["metadata"]
    metadata = metadata if isinstance(metadata, dict) else orjson.loads(metadata)
    counts = batch.counts(True)
    by_status = {"completed": counts["succeeded"], "failed": counts["errored"]}
    assert metadata["rows_by_status"] == by_status


@pytest.mark.parametrize("case", ["foreign_host", "archived"])
async def test_results_nopoll_must_not_or_cannot_fetch_become_a_dead_letter_saying_why(
    anthropic_stack, provider_sim, redis_url, case
):
    settings, sim, store = anthropic_stack()
    other = provider_sim()  # another host:port that would gladly take the API key
    options = {"results_origin": other.host_url} if case == "foreign_host" else {"archived": True}
    sim.add_batch("anthropic", "msgbatch_bad", 5, **options)
    await store.register("sim", "batch", "msgbatch_bad", first_poll_in_s=0.2)
    async with running_worker(settings, redis_url):
        found = await wait_for(lambda: letters(redis_url, key="msgbatch_bad"), timeout=30)
    assert other.request_count() == 0  # the key never went to the other host
    reason = "results_url is not on base_url" if case == "foreign_host" else "archived"
    assert reason in found[0].error, found[0].error
    assert sim.request_count("/v1/messages/batches/msgbatch_bad/results") == 0


# --- nopoll submit --batch -------------------------------------------------------------
def _config(tmp_path, sim, redis_url, pg_url, pg_table):
    return write_config(
        tmp_path,
        sim.host_url,
        redis_url=redis_url,
        sinks=sql_sink(pg_url, pg_table),
        dialect="anthropic",
        provider=f"    api_key: {KEY}\n"
        "    watch: {first_poll_s: 0.2, max_interval_s: 0.5, rate_limit_rps: 200}\n",
    )


def _chat_line(i: int) -> dict:
    body = {
        "model": "claude-m",
        "max_tokens": 64,
        "temperature": 0.2,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": f"question {i}"}]},
        ],
    }
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _native_line(i: int) -> dict:
    params = {
        "model": "claude-m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": f"question {i}"}],
    }
    return {"custom_id": f"n{i}", "params": params}


@pytest.mark.parametrize("form", ["openai_chat", "native"])
async def test_submit_batch_creates_a_message_batch_from_either_form_then_lands(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, form
):
    sim = provider_sim(api_key=KEY, complete_after_s=0.5)
    sim.anthropic.create_fail_times = 1  # 529 overloaded first: retried with the same key
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    procs.start("worker", "--config", str(config))
    source = tmp_path / "batch.jsonl"
    make = _chat_line if form == "openai_chat" else _native_line
    source.write_bytes(b"".join(orjson.dumps(make(i)) + b"\n" for i in range(30)))
    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--batch", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    [(key, body)] = list(sim.anthropic.received)
    assert key and set(body) == {"requests"} and len(body["requests"]) == 30
    if form == "openai_chat":
        assert body["requests"][0] == {
            "custom_id": "c0",
            "params": {
                "model": "claude-m",
                "max_tokens": 64,
                "system": "Be brief.",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "question 0"}]}],
                "temperature": 0.2,
            },
        }
    else:
        assert body["requests"][0] == _native_line(0)
    rows = await wait_pg_rows(pg_url, pg_table, 31)
    batch_rows = [r for r in rows if r["kind"] == "batch_row"]
    assert len(batch_rows) == 30 and all(r["status"] == "completed" for r in batch_rows)
    prefix = "c" if form == "openai_chat" else "n"
    assert {r["custom_id"] for r in batch_rows} == {f"{prefix}{i}" for i in range(30)}
    again = await asyncio.to_thread(nopoll_submit, procs, config, source, "--batch")
    assert again.returncode == 0 and "already submitted" in again.stdout
    assert len(sim.anthropic.created) == 1


async def test_a_file_anthropic_cannot_express_is_refused_before_anything_is_sent(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    sim = provider_sim(api_key=KEY)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    good = _chat_line(0)
    tools = _chat_line(1)
    tools["body"]["tools"] = [{"type": "function", "function": {"name": "f"}}]
    no_max = _chat_line(2)
    del no_max["body"]["max_tokens"]
    bad_id = {**_native_line(3), "custom_id": "has space"}
    image = _chat_line(4)
    image["body"]["messages"][1]["content"] = [{"type": "image_url", "image_url": {"url": "x"}}]
    twice = _native_line(5) | {"custom_id": "c0"}
    lines = [good, tools, no_max, bad_id, image, twice]
    source = tmp_path / "bad.jsonl"
    source.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--batch")
    assert done.returncode == 1, done.stdout + done.stderr
    for expected in (
        "line 2: body.tools: has no Messages equivalent",
        "line 3: body.max_tokens: required by Anthropic",
        "line 4: custom_id: 1 to 64 characters",
        "line 5: body.messages[1].content: a image_url part has no Messages equivalent",
        "line 6: custom_id: c0 is also on line 1",
    ):
        assert expected in done.stderr, done.stderr
    assert sim.request_count("/v1/") == 0  # checked before anything was sent
    plain = await asyncio.to_thread(nopoll_submit, procs, config, source)
    assert plain.returncode == 2 and "--batch" in plain.stderr


async def test_a_file_over_the_limits_becomes_several_batches_each_created_once_and_watched(
    make_settings, provider_sim, redis_url, tmp_path
):
    from receiver.providers.anthropic import AnthropicDialect
    from receiver.providers.client import ProviderClient
    from receiver.submit.batch import submit_batch
    from receiver.submit.creates import Submitter

    sim = provider_sim(api_key=KEY)
    settings = make_settings(sim.host_url, redis_url=redis_url)
    config = settings.providers["sim"].model_copy(
        update={"dialect": "anthropic", "webhook_secrets": []}
    )
    lines = [(n, orjson.dumps(_native_line(n))) for n in range(1, 11)]
    one = len(lines[0][1])
    redis = Redis.from_url(redis_url)
    client = ProviderClient("sim", config, settings.http)
    try:
        submitter = Submitter("sim", config, client, redis)
        # at most 4 requests, and at most 3 by bytes: parts of 3, 3, 3, 1
        small = type("Small", (AnthropicDialect,), {"max_requests": 4, "max_bytes": 3 * one + 20})
        first = await submit_batch(submitter, lines, "d" * 64, "f", dialect=small)
        again = await submit_batch(submitter, lines, "d" * 64, "f", dialect=small)
        watched = [await WatchStore(redis).get("sim", "batch", b) for b in first.batch_ids]
    finally:
        await client.aclose()
        await redis.aclose()
    assert not first.rejected and first.rows == 10
    assert [len(body["requests"]) for _, body in sim.anthropic.received] == [3, 3, 3, 1]
    assert first.batch_ids == sim.anthropic.created and len(set(first.batch_ids)) == 4
    assert again.already and again.batch_ids == first.batch_ids
    assert len(sim.anthropic.created) == 4  # the rerun created nothing
    assert all(w is not None for w in watched)
    keys = [key for key, _ in sim.anthropic.received]
    assert len(set(keys)) == 4  # one Idempotency-Key per part
