"""Each provider account's request budget end to end: two worker processes and ``nopoll
submit`` against one account, counted at the provider; a quota refusal ends each kind of
work at once, saying what the provider said."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from redis.asyncio import Redis

from receiver.watches.store import WatchStore
from tests.e2e.helpers import (
    nopoll_submit,
    post,
    sql_sink,
    wait_for,
    wait_pg_rows,
    write_config,
)
from tests.e2e.losses import letters
from tests.limited_provider import OPENAI_QUOTA, VALAR_QUOTA, max_in_any_second
from tests.servers import running_api, running_worker

pytestmark = pytest.mark.slow

KEY = "sk-test-not-a-real-key"


def _lines(path, n: int):
    with path.open("wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"model": "m-1", "input": f"q {i}", "custom_id": f"q{i:03d}"}))
            f.write(b"\n")
    return path


async def test_polls_row_gets_and_creates_of_two_workers_and_submit_share_one_budget(
    procs, limited_sim, redis_url, tmp_path, pg_url, pg_table
):
    """``rate_limit_rps: 5`` for a valar account: watch polls (allowed 50/s on their own),
    the per-row GETs of a batch a poll found finished, and ``nopoll submit``'s creates,
    from two ``nopoll worker`` processes and the CLI at once: never more than 5 requests
    in any one second at the provider, and everything lands."""
    sim = limited_sim(api_key=KEY, complete_after_s=1.0)
    until = time.time() + 2
    for i in range(8):
        sim.add_response(f"resp_w_{i}", pending_until=until)
    sim.add_batch("valar", "batch_budget", 30, pending_until=until)
    config = write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        sinks=sql_sink(pg_url, pg_table),
        dialect="valar",
        provider=f"    api_key: {KEY}\n"
        "    rate_limit_rps: 5\n"
        "    watch: {first_poll_s: 0.3, max_interval_s: 1, rate_limit_rps: 50}\n",
        extra="batch: {chunk_size: 10, lease_s: 5}\n",
    )
    for _ in range(2):
        procs.start("worker", "--config", str(config))
    redis = Redis.from_url(redis_url)
    store = WatchStore(redis)
    try:
        await store.register_all(
            "sim", "response", [f"resp_w_{i}" for i in range(8)], first_poll_in_s=0.3
        )
        await store.register_all("sim", "batch", ["batch_budget"], first_poll_in_s=0.3)
        source = _lines(tmp_path / "requests.jsonl", 6)
        submitted = await asyncio.to_thread(nopoll_submit, procs, config, source)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        # 8 watched responses, 30 rows and the batch's summary, 6 created responses
        await wait_pg_rows(pg_url, pg_table, 45, timeout=100, interval=0.5)
    finally:
        await redis.aclose()
    seen = sim.seen("/v1/")
    stamps = [s.at for s in seen]
    assert max_in_any_second(stamps) <= 5, procs.logs()[-3000:]
    assert max_in_any_second(stamps) >= 4  # the budget was what held them back
    assert len([s for s in seen if s.method == "POST"]) == 6
    assert len(sim.seen("/v1/batches/batch_budget/row-")) == 30


async def test_a_fetch_refused_for_insufficient_quota_is_a_dead_letter_at_once(
    limited_sim, make_settings, redis_url, signed_callback
):
    sim = limited_sim(api_key=KEY)
    sim.add_response("resp_quota")
    sim.refuse("/v1/responses/resp_quota", body=OPENAI_QUOTA, retry_after=1)
    settings = make_settings(sim.base_url, redis_url=redis_url)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        assert (await post(base, *signed_callback("resp_quota"))).status_code == 202
        [letter] = await wait_for(lambda: letters(redis_url, sink="fetch"), timeout=20)
        await asyncio.sleep(0.5)
    assert letter.attempts == 1
    assert OPENAI_QUOTA["error"]["message"] in letter.error
    assert "insufficient_quota" in letter.error
    assert len(sim.seen("/v1/responses/resp_quota")) == 1  # never retried


async def test_a_batch_row_refused_for_insufficient_quota_ends_the_batch_job_at_once(
    limited_sim, make_settings, redis_url, signed_callback
):
    sim = limited_sim(api_key=KEY)
    sim.add_batch("valar", "batch_quota", 20)
    sim.refuse("/v1/batches/batch_quota/row-000007", body=VALAR_QUOTA)
    settings = make_settings(sim.base_url, redis_url=redis_url)
    provider = settings.providers["sim"].model_copy(update={"dialect": "valar"})
    settings = settings.model_copy(update={"providers": {"sim": provider}})
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        callback = signed_callback("batch_quota", event_type="batch.completed")
        assert (await post(base, *callback)).status_code == 202
        [letter] = await wait_for(lambda: letters(redis_url, sink="fetch"), timeout=30)
        await asyncio.sleep(0.5)
    assert letter.attempts == 1 and letter.function == "fetch_batch"
    assert VALAR_QUOTA["error"]["message"] in letter.error
    assert len(sim.seen("/v1/batches/batch_quota/row-000007")) == 1


async def test_a_watch_refused_for_insufficient_quota_ends_as_a_dead_letter_at_once(
    watch_stack, limited_sim, redis_url
):
    settings, _, store = watch_stack("valar")
    sim = limited_sim(api_key=KEY)
    provider = settings.providers["sim"].model_copy(update={"base_url": sim.base_url})
    settings = settings.model_copy(update={"providers": {"sim": provider}})
    sim.add_response("resp_broke")
    sim.refuse("/v1/responses/resp_broke", body=VALAR_QUOTA)
    assert await store.register("sim", "response", "resp_broke", first_poll_in_s=0.2)
    async with running_worker(settings, redis_url):
        [letter] = await wait_for(lambda: letters(redis_url, sink="watch"), timeout=20)
        await asyncio.sleep(1.5)  # long enough for more polls, if any came
    assert VALAR_QUOTA["error"]["message"] in letter.error
    assert "insufficient_quota" in letter.error
    assert letter.function == "fetch_response" and letter.keys == ["resp_broke"]
    assert len(sim.seen("/v1/responses/resp_broke")) == 1
    watch = await store.get("sim", "response", "resp_broke")
    assert watch is not None and watch.state == "expired"


async def test_submit_stops_creating_at_the_first_quota_refusal_and_a_rerun_goes_on(
    procs, limited_sim, redis_url, tmp_path
):
    sim = limited_sim(api_key=KEY)
    sim.refuse("/v1/responses", body=VALAR_QUOTA, method="POST", after=3)
    config = write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        dialect="valar",
        provider=f"    api_key: {KEY}\n    rate_limit_rps: 50\n",
    )
    source = _lines(tmp_path / "requests.jsonl", 10)
    first = await asyncio.to_thread(nopoll_submit, procs, config, source, "--concurrency", "1")
    assert first.returncode == 1, first.stdout + first.stderr
    assert "3 submitted, 0 already submitted, 7 rejected" in first.stdout
    assert len(sim.seen("/v1/responses", method="POST")) == 4  # the refused one, then none
    assert VALAR_QUOTA["error"]["message"] in first.stderr
    report = [
        orjson.loads(x)
        for x in (tmp_path / "requests.jsonl.rejected.jsonl").read_bytes().splitlines()
    ]
    assert [r["line"] for r in report] == list(range(4, 11))
    assert report[0]["status"] == 429
    assert VALAR_QUOTA["error"]["message"] in report[0]["error"]
    for later in report[1:]:
        assert later["error"].startswith("not submitted: ")
        assert "insufficient_quota" in later["error"]

    sim.lift()
    again = await asyncio.to_thread(nopoll_submit, procs, config, source)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "7 submitted, 3 already submitted, 0 rejected" in again.stdout
    assert sim.creations("responses") == 10
