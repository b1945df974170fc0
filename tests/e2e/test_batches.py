"""Batches end to end: every dialect, resumption, retries, hand-offs, duplicates."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections import Counter
from pathlib import Path

import httpx
import pytest

from receiver.cli import main
from sinks import registry
from tests.e2e.helpers import jsonl_rows, pg_rows, post, queues_empty, wait_for, write_config
from tests.servers import running_api, running_worker

BATCH = {"chunk_size": 200, "lease_s": 2, "sink_attempts": 2, "max_jobs": 2}


@pytest.fixture
def batch_stack(make_settings, redis_url, provider_sim, pg_url, pg_table, tmp_path):
    def make(dialect: str, *, extra_sinks: dict | None = None, **overrides):
        sim = provider_sim(api_key="sk-test-not-a-real-key")
        sinks = {
            "warehouse": {"type": "sql", "url": pg_url, "table": pg_table},
            "files": {"type": "jsonl", "dir": str(tmp_path / "results")},
            **(extra_sinks or {}),
        }
        settings = make_settings(
            sim.base_url,
            redis_url=redis_url,
            sinks=sinks,
            batch=overrides.pop("batch", BATCH),
            **overrides,
        )
        provider = settings.providers["sim"].model_copy(update={"dialect": dialect})
        settings = settings.model_copy(update={"providers": {"sim": provider}})
        return settings, sim

    return make


def expected_keys(batch) -> set[str]:
    """``{batch_id}/{custom_id}``; ``{batch_id}/~{i}`` for a row without one (its line index)."""
    return {
        f"{batch.batch_id}/{cid}"
        if (cid := batch.custom_id(i)) is not None
        else f"{batch.batch_id}/~{i}"
        for i in range(batch.n_rows)
    }


async def rows_when_summary(pg_url, pg_table, batch_id):
    async def done():
        rows = await pg_rows(pg_url, pg_table)
        return rows if any(r["kind"] == "batch" and r["key"] == batch_id for r in rows) else None

    return await wait_for(done, timeout=60, interval=0.2)


@pytest.mark.parametrize(
    ("dialect", "options"),
    [
        ("openai", {"failed_every": 13}),
        ("sference", {"failed_every": 11, "no_custom_id_every": 9}),
        ("sail", {"failed_every": 17, "shape": "guide"}),  # its guide's inline results
        ("sail", {"failed_every": 17, "shape": "guide", "inline": False}),
        ("valar", {"failed_every": 19, "cancelled_every": 23}),
    ],
    ids=["openai", "sference", "sail-inline", "sail-results-null", "valar"],
)
async def test_every_dialect_delivers_every_row_then_the_summary(
    batch_stack, redis_url, signed_callback, pg_url, pg_table, tmp_path, dialect, options
):
    settings, sim = batch_stack(dialect)
    batch = sim.add_batch(dialect, f"batch_{dialect}", 1500, **options)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        r = await post(base, *signed_callback(batch.batch_id, event_type="batch.completed"))
        assert r.status_code == 202 and r.json()["status"] == "queued"
        rows = await rows_when_summary(pg_url, pg_table, batch.batch_id)

    row_rows = [r for r in rows if r["kind"] == "batch_row"]
    assert {r["key"] for r in row_rows} == expected_keys(batch)
    assert len(row_rows) == batch.n_rows
    by_key = {r["key"]: r for r in row_rows}
    statuses = Counter(r["status"] for r in row_rows)
    counts = batch.counts()
    assert statuses["completed"] == counts["completed"]
    assert statuses["failed"] == counts["failed"]
    assert statuses.get("cancelled", 0) == counts["cancelled"]
    for i in (0, 5, batch.n_rows - 1):
        key = f"{batch.batch_id}/{batch.custom_id(i) or i}"
        row = by_key[key]
        assert row["batch_id"] == batch.batch_id and row["custom_id"] == batch.custom_id(i)
        if batch.row_status(i) == "completed":
            assert row["output_text"] == batch.text(i) and row["usable"] is True
            assert row["output_tokens"] in (3, 7)
        else:
            assert row["output_text"] is None and row["usable"] is False
            if dialect != "valar":
                assert json.loads(row["error"])["message"]
    summary = next(r for r in rows if r["kind"] == "batch")
    meta = json.loads(summary["metadata"])
    assert meta["request_counts"]["total"] == batch.n_rows
    assert sum(meta["rows_by_status"].values()) == batch.n_rows
    assert summary["status"] == "completed" and summary["usable"] is True
    assert "results" not in json.loads(summary["body"])
    # JSONL: every row once, the summary written after all of them
    lines = jsonl_rows(tmp_path / "results")
    assert len(lines) == batch.n_rows + 1
    assert lines[-1]["kind"] == "batch"


async def test_valar_row_500_is_retried(batch_stack, redis_url, signed_callback, pg_url, pg_table):
    settings, sim = batch_stack("valar")
    batch = sim.add_batch(
        "valar", "batch_flaky_rows", 300, row_failures={"row-000010": 1, "row-000250": 3}
    )
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        await post(base, *signed_callback(batch.batch_id, event_type="batch.completed"))
        rows = await rows_when_summary(pg_url, pg_table, batch.batch_id)
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 300
    assert batch.served["row-000010"] == 2
    # 3 failures > 2 in-job attempts: the job was retried and resumed after the committed chunk
    assert batch.served["row-000250"] == 4
    assert batch.served["row-000001"] == 1  # chunk 0 was not fetched again


async def test_sink_failing_on_chunk_3_is_retried_alone(
    batch_stack, redis_url, signed_callback, pg_url, pg_table, tmp_path, monkeypatch
):
    monkeypatch.setitem(
        registry.BUILTIN_SINKS, "flaky", registry.SinkType("tests.sinks.flaky:FlakySink")
    )
    flaky_dir = tmp_path / "flaky"
    settings, sim = batch_stack(
        "sference",
        extra_sinks={
            "flaky": {"type": "flaky", "dir": str(flaky_dir), "fail_write": 3, "fail_times": 4}
        },
    )
    batch = sim.add_batch("sference", "batch_chunk3", 1000)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        await post(base, *signed_callback(batch.batch_id, event_type="batch.completed"))
        rows = await rows_when_summary(pg_url, pg_table, batch.batch_id)
        assert len(rows) == 1001  # Postgres did not wait for the flaky sink

        def flaky_done():
            lines = jsonl_rows(flaky_dir)
            return lines if any(line["kind"] == "batch" for line in lines) else None

        lines = await wait_for(lambda: asyncio.to_thread(flaky_done), timeout=30)
    keys = [line["key"] for line in lines if line["kind"] == "batch_row"]
    assert sorted(keys) == sorted(expected_keys(batch)) and len(keys) == len(set(keys))
    assert lines[-1]["kind"] == "batch"  # the summary came after the retried chunk


async def test_duplicate_batch_callbacks_write_rows_once(
    batch_stack, redis_url, signed_callback, pg_url, pg_table, tmp_path
):
    settings, sim = batch_stack("sference")
    batch = sim.add_batch("sference", "batch_dup", 500)
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        first = signed_callback(batch.batch_id, event_type="batch.completed")
        assert (await post(base, *first)).status_code == 202
        assert (await post(base, *first)).status_code == 200  # same webhook-id
        await rows_when_summary(pg_url, pg_table, batch.batch_id)
        # a new delivery of the same event after the batch was delivered
        again = await post(base, *signed_callback(batch.batch_id, event_type="batch.completed"))
        assert again.status_code == 202
        await wait_for(lambda: queues_empty(redis_url))  # that job ran, and found it done
    assert sim.request_count(f"/v1/batches/{batch.batch_id}/results.jsonl") == 1
    assert len(jsonl_rows(tmp_path / "results")) == 501


@pytest.fixture
def start_valar_batch(procs, tmp_path, redis_url, pg_url, pg_table, signed_callback, make_settings):
    """Factory: a `nopoll worker` process (valar, Postgres sink, 200-row chunks, 2 s lease)
    and the batch's signed callback posted to an in-process API; (worker, config path)."""

    async def start(sim, batch, worker_extra: str = ""):
        config = write_config(
            tmp_path,
            sim.base_url,
            redis_url=redis_url,
            sinks=f"  db: {{type: sql, url: '{pg_url}', table: {pg_table}}}\n",
            extra="batch: {chunk_size: 200, lease_s: 2}\n",
        )
        # the simulator has no request limit (valar's default budget would be 1/s)
        text = config.read_text().replace(
            "dialect: openai", "dialect: valar\n    rate_limit_rps: null"
        )
        extra = f"health_check_interval_s: 1{worker_extra}}}"
        config.write_text(text.replace("health_check_interval_s: 1}", extra))
        worker = procs.start("worker", "--config", str(config))
        settings = make_settings(sim.base_url, redis_url=redis_url)
        async with running_api(settings, redis_url) as (base, _), httpx.AsyncClient() as client:
            body, headers = signed_callback(batch.batch_id, event_type="batch.completed")
            r = await client.post(f"{base}/webhooks/sim", content=body, headers=headers)
            assert r.status_code == 202
        return worker, config

    return start


@pytest.mark.slow
async def test_worker_killed_mid_batch_resumes_after_the_last_chunk(
    procs, provider_sim, redis_sync_client, pg_url, pg_table, start_valar_batch
):
    sim = provider_sim()
    batch = sim.add_batch("valar", "batch_kill", 3000, failed_every=29, row_delay_s=0.01)
    worker, config = await start_valar_batch(sim, batch)

    async def some_chunks_committed():
        value = redis_sync_client.hget(f"nopoll:batch:sim:{batch.batch_id}", "c:db")
        return value is not None and int(value) >= 3

    await wait_for(some_chunks_committed, timeout=60, interval=0.05)
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    fetched_before = sum(batch.served.values())
    assert fetched_before < batch.counts()["completed"]  # really mid-batch
    procs.start("worker", "--config", str(config))
    rows = await rows_when_summary(pg_url, pg_table, batch.batch_id)
    row_keys = [r["key"] for r in rows if r["kind"] == "batch_row"]
    assert sorted(row_keys) == sorted(expected_keys(batch)), procs.logs()
    # resumed after the committed chunks, not from row 0
    refetched = sum(batch.served.values()) - batch.counts()["completed"]
    assert 0 <= refetched < fetched_before
    # the summary counts the rows of both runs
    summary = next(r for r in rows if r["kind"] == "batch")
    assert sum(json.loads(summary["metadata"])["rows_by_status"].values()) == batch.n_rows


def test_fetch_batch_command(
    tmp_path: Path, provider_sim, redis_url, pg_url, pg_table, capsys, monkeypatch, webhook_secret
):
    sim = provider_sim()
    batch = sim.add_batch("openai", "batch_cli", 700, failed_every=10)
    config = write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        sinks=f"  db: {{type: sql, url: '{pg_url}', table: {pg_table}}}\n",
    )
    monkeypatch.setenv("SIM_SECRET", webhook_secret)
    assert main(["fetch-batch", "--config", str(config), "sim", batch.batch_id]) == 0
    out = capsys.readouterr().out
    assert "700 rows delivered" in out
    rows = asyncio.run(pg_rows(pg_url, pg_table))
    assert len(rows) == 701
    assert main(["fetch-batch", "--config", str(config), "sim", batch.batch_id]) == 0
    assert "already delivered" in capsys.readouterr().out
    assert main(["fetch-batch", "--config", str(config), "sim", "../etc"]) == 2


@pytest.mark.slow
async def test_sigterm_during_a_batch_exits_cleanly_and_the_batch_completes_on_restart(
    procs, provider_sim, redis_sync_client, pg_url, pg_table, start_valar_batch
):
    sim = provider_sim()
    batch = sim.add_batch("valar", "batch_term", 2000, row_delay_s=0.01)
    worker, config = await start_valar_batch(sim, batch, worker_extra=", shutdown_wait_s: 1")

    async def started():
        value = redis_sync_client.hget(f"nopoll:batch:sim:{batch.batch_id}", "c:db")
        return value is not None

    await wait_for(started, timeout=60, interval=0.05)
    worker.send_signal(signal.SIGTERM)
    try:
        # shutdown_wait_s is 1: the running batch is cancelled after a second and comes back
        code = await asyncio.to_thread(worker.wait, 45)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within 45 s of SIGTERM:\n{procs.logs()}")
    assert code == 0, procs.logs()
    procs.start("worker", "--config", str(config))
    rows = await rows_when_summary(pg_url, pg_table, batch.batch_id)
    assert sorted(r["key"] for r in rows if r["kind"] == "batch_row") == sorted(
        expected_keys(batch)
    )
