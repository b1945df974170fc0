"""Each provider account's request budget end to end: two worker processes and ``nopoll
submit`` against one account, counted at the provider."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from redis.asyncio import Redis

from receiver.watches.store import WatchStore
from tests.e2e.helpers import nopoll_submit, sql_sink, wait_pg_rows, write_config
from tests.limited_provider import max_in_any_second

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
