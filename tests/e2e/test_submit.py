"""``nopoll submit`` end to end: the provider simulator's create endpoints (idempotency,
failing first tries, rejections, the four batch dialects), a real worker, real Postgres."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import orjson
import pytest

from receiver.submit.creates import file_digest, record_key, sending_key
from tests.e2e.helpers import (
    SIGNED,
    nopoll_submit,
    pg_rows,
    sql_sink,
    wait_for,
    wait_pg_rows,
    wait_ready,
    write_config,
)
from tests.servers import free_port

pytestmark = pytest.mark.slow

WATCH = (
    "    rate_limit_rps: null\n"  # the simulator has no request limit (valar's would be 1/s)
    "    watch: {first_poll_s: 0.2, max_interval_s: 0.5, rate_limit_rps: 200}\n"
)


def _config(tmp_path, sim, redis_url, pg_url, pg_table, dialect="openai", *, callbacks=False):
    return write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        sinks=sql_sink(pg_url, pg_table),
        dialect=dialect,
        provider=SIGNED if callbacks else WATCH,
    )


def _lines(path: Path, n: int, overrides: dict[int, dict] | None = None) -> Path:
    with path.open("wb") as f:
        for i in range(n):
            body = {"model": "m-1", "input": f"question {i}", "custom_id": f"q{i:04d}"}
            f.write(orjson.dumps({**body, **(overrides or {}).get(i, {})}) + b"\n")
    return path


async def test_500_lines_with_failing_first_tries_create_500_responses_and_rows_once(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    sim = provider_sim(create_fail_first=0.1, create_fail_mode="after", complete_after_s=0.5)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    procs.start("worker", "--config", str(config))
    source = _lines(tmp_path / "requests.jsonl", 500)
    first = await asyncio.to_thread(nopoll_submit, procs, config, source, "--wait")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "500 submitted, 0 already submitted, 0 rejected" in first.stdout
    assert "landed by status: 500 completed" in first.stdout
    assert sim.creations("responses") == 500  # retried failures replayed, never repeated
    failed_first = [r for r in sim.creates.received("/v1/responses")]
    assert len(failed_first) > 500  # some first tries did fail and were retried
    rows = await wait_pg_rows(pg_url, pg_table, 500, timeout=60)
    assert len({r["key"] for r in rows}) == 500
    metadata = [m if isinstance(m := r["metadata"], dict) else orjson.loads(m) for r in rows]
    assert {m["custom_id"] for m in metadata} == {f"q{i:04d}" for i in range(500)}

    again = await asyncio.to_thread(nopoll_submit, procs, config, source)
    assert again.returncode == 0, again.stderr
    assert "0 submitted, 500 already submitted" in again.stdout
    assert sim.creations("responses") == 500  # the same file again: nothing new
    assert len(sim.creates.received("/v1/responses")) == len(failed_first)  # not one POST


async def test_an_overloaded_provider_is_retried_after_its_retry_after(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    """Every first try answers 529 with ``Retry-After: 1.5``: each line waits that long under
    its same key, and every line is created once."""
    sim = provider_sim(create_fail_first=1.0, create_fail_status=529, create_retry_after=1.5)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    source = _lines(tmp_path / "requests.jsonl", 20)
    started = asyncio.get_running_loop().time()
    result = await asyncio.to_thread(nopoll_submit, procs, config, source)
    took = asyncio.get_running_loop().time() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert "20 submitted, 0 already submitted, 0 rejected" in result.stdout
    assert sim.creations("responses") == 20
    received = sim.creates.received("/v1/responses")
    assert len(received) == 40  # one refused try and one retry per line, no more
    assert len({r.idempotency_key for r in received}) == 20  # the retry reused its key
    assert took >= 1.5, f"the retries did not wait for Retry-After ({took:.2f} s)"


async def test_a_rejected_line_is_reported_with_its_reason_and_the_rest_land(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    sim = provider_sim(complete_after_s=0.2)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    procs.start("worker", "--config", str(config))
    source = _lines(tmp_path / "mixed.jsonl", 20, {7: {"model": "reject-me"}})
    with source.open("ab") as f:
        f.write(b"this is not json\n")
        f.write(orjson.dumps({"model": "m-1", "input": "again", "custom_id": "q0003"}) + b"\n")
    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--wait")
    assert done.returncode == 1
    assert "19 submitted, 0 already submitted, 3 rejected" in done.stdout
    assert "line 8 (HTTP 400): model reject-me does not exist" in done.stderr
    report = [
        orjson.loads(x) for x in (tmp_path / "mixed.jsonl.rejected.jsonl").read_bytes().splitlines()
    ]
    assert report[0] == {
        "line": 8,
        "custom_id": "q0007",
        "status": 400,
        "error": "model reject-me does not exist",
    }
    assert report[1]["line"] == 21 and report[1]["status"] is None
    assert report[1]["error"].startswith("not JSON")
    assert report[2] == {
        "line": 22,
        "custom_id": "q0003",
        "status": None,
        "error": "custom_id: q0003 is also on line 4",
    }
    assert sim.creations("responses") == 19
    rows = await wait_pg_rows(pg_url, pg_table, 19, timeout=60)
    assert len(rows) == 19


@pytest.mark.parametrize("dialect", ["openai", "sference", "sail", "valar"])
async def test_a_batch_is_created_in_the_dialects_own_shape_then_lands(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, dialect
):
    sim = provider_sim(dialect=dialect, complete_after_s=0.5)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table, dialect)
    procs.start("worker", "--config", str(config))
    source = tmp_path / "batch.jsonl"
    with source.open("wb") as f:
        for i in range(30):
            body = {"model": "m-1", "input": f"q {i}"}
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/responses", "body": body}
            f.write(orjson.dumps(line) + b"\n")
    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--batch", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    [create] = sim.creates.received("/v1/batches")
    assert create.idempotency_key
    first = {"model": "m-1", "input": "q 0"}
    if dialect == "openai":
        [upload] = sim.creates.received("/v1/files")
        assert upload.body["purpose"] == "batch" and len(upload.body["file"]) == 30
        assert create.body == {
            "input_file_id": create.body["input_file_id"],
            "endpoint": "/v1/responses",
            "completion_window": "24h",
        }
    elif dialect == "sference":
        assert create.body["window"] == "24h" and set(create.body) == {"window", "requests"}
        assert create.body["requests"][0] == {"custom_id": "c0", "body": first}
    else:
        assert create.body["endpoint"] == "/v1/responses" and create.body["label"]
        assert create.body["requests"][0] == {"custom_id": "c0", "params": first}
    rows = await wait_pg_rows(pg_url, pg_table, 31, timeout=60)
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 30
    assert [r["kind"] for r in rows].count("batch") == 1
    again = await asyncio.to_thread(nopoll_submit, procs, config, source, "--batch")
    assert again.returncode == 0 and "already submitted" in again.stdout
    assert sim.creations("batches") == 1


async def test_a_bad_batch_file_sends_nothing_and_lists_every_bad_line(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    sim = provider_sim(dialect="sference")
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table, "sference")
    source = tmp_path / "bad.jsonl"
    rows = [
        {"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": {"model": "m-1"}},
        {"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": {"model": "m-1"}},
        {"custom_id": "b", "method": "POST", "url": "/v1/responses", "body": {"model": "m-2"}},
        {"custom_id": "c", "method": "POST", "url": "/v1/responses", "body": {"model": "m-1"}},
    ]
    for row in rows[:3]:
        row["body"]["input"] = "x"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--batch")
    assert done.returncode == 1
    assert "line 2: custom_id: a appears twice" in done.stderr
    assert "line 3: body.model: m-2, but the batch's first line has m-1" in done.stderr
    # sference refuses a row without messages or input at create: listed here first
    assert "line 4: body: needs a non-empty messages list or a Responses input" in done.stderr
    assert sim.request_count("/v1/") == 0  # checked before anything was sent


async def test_sigkill_halfway_then_a_rerun_creates_no_duplicate(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    sim = provider_sim(create_delay_s=0.05, complete_after_s=0.2)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    source = _lines(tmp_path / "big.jsonl", 600)
    killed = procs.start(
        "submit", "--config", str(config), "sim", str(source), "--concurrency", "20"
    )

    async def halfway():
        return sim.creations("responses") >= 200

    await wait_for(halfway, timeout=60)
    killed.send_signal(signal.SIGKILL)
    killed.wait(10)
    before = sim.creations("responses")
    assert before < 600
    procs.start("worker", "--config", str(config))
    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sim.creations("responses") == 600  # every line once, none twice
    rows = await wait_pg_rows(pg_url, pg_table, 600, timeout=90)
    assert len({r["key"] for r in rows}) == 600


async def test_with_callbacks_each_result_costs_one_create_and_one_fetch(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, webhook_secret
):
    port = free_port()
    sim = provider_sim(
        complete_after_s=0.3,
        webhook_url=f"http://127.0.0.1:{port}/webhooks/sim",
        webhook_secret=webhook_secret,
    )
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table, callbacks=True)
    procs.start("serve", "--config", str(config), "--port", str(port))
    await asyncio.to_thread(wait_ready, port)
    source = _lines(tmp_path / "called.jsonl", 100)
    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = await wait_pg_rows(pg_url, pg_table, 100, timeout=60)
    assert len(rows) == 100 and all(r["event_id"] for r in rows)  # landed by callbacks
    assert sim.creations("responses") == 100
    assert sim.request_count("/v1/responses/") == 100  # one fetch each, not one poll
    assert "provider requests per result: 2.00 (100 creates, 0 polls, 100 callback" in done.stdout
    assert "landed by status: 100 completed" in done.stdout


@pytest.mark.parametrize("batch", [False, True])
def test_an_empty_file_is_refused_with_a_word(procs, tmp_path, provider_sim, redis_url, batch):
    sim = provider_sim(dialect="openai")
    config = _config(tmp_path, sim, redis_url, "sqlite://", "t")
    source = tmp_path / "empty.jsonl"
    source.write_text("\n  \n")
    done = nopoll_submit(procs, config, source, *(["--batch"] if batch else []), "--wait")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{source} holds no request" in done.stderr
    assert sim.request_count("/v1/") == 0


async def test_batch_wait_returns_once_every_row_is_in_the_sink_and_a_rerun_counts_them(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    """``--batch --wait`` waited for the batch object only ("1/1") and returned while the
    rows still streamed; it now waits for the rows and the summary, showing them. A rerun
    shows what already ended (it showed ``0/1 landed 1``)."""
    sim = provider_sim(dialect="openai", complete_after_s=0.5)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table)
    config.write_text(config.read_text() + "batch: {chunk_size: 50}\n")
    procs.start("worker", "--config", str(config))
    source = tmp_path / "batch.jsonl"
    with source.open("wb") as f:
        for i in range(1500):
            body = {"model": "m-1", "input": f"q {i}"}
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/responses", "body": body}
            f.write(orjson.dumps(line) + b"\n")
    procs.env = {**procs.env, "COLUMNS": "200"}
    done = await asyncio.to_thread(nopoll_submit, procs, config, source, "--batch", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = await pg_rows(pg_url, pg_table)  # right away: no waiting after the command
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 1500
    assert [r["kind"] for r in rows].count("batch") == 1
    assert "1500 batch row(s) of 1500 fetched; 1/1 batch(es) in the sinks" in done.stdout
    assert re.search(r"\d+ polls \(\d+\.\d/s\)", done.stdout), done.stdout
    again = await asyncio.to_thread(nopoll_submit, procs, config, source, "--batch", "--wait")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1/1 landed 1" in again.stdout, again.stdout


# --- sference documents no idempotency: a lost answer is looked up, not sent again ------
def _in_doubt(source: Path) -> list[int]:
    """The lines the last run reported in doubt (from its rejected-lines file)."""
    report = source.with_name(source.name + ".rejected.jsonl")
    rows = [orjson.loads(line) for line in report.read_bytes().splitlines()]
    return sorted(r["line"] for r in rows if r["error"].startswith("in doubt: "))


@pytest.fixture
def sference_submit(procs, tmp_path, provider_sim, redis_url, pg_url, pg_table):
    """Factory: ``nopoll submit --wait`` of ``n`` lines to a sference simulator (``sim``:
    its settings) with a worker running; returns (simulator, config, file, the run)."""

    async def run(n: int, **sim):
        sim = provider_sim(dialect="sference", create_fail_status=502, **sim)
        config = _config(tmp_path, sim, redis_url, pg_url, pg_table, "sference")
        procs.start("worker", "--config", str(config))
        source = _lines(tmp_path / "requests.jsonl", n)
        done = await asyncio.to_thread(
            nopoll_submit, procs, config, source, "--wait", "--settle-after", "0.5"
        )
        return sim, config, source, done

    return run


async def test_a_sference_create_whose_answer_was_lost_is_found_not_sent_twice(
    procs, pg_url, pg_table, sference_submit
):
    """A fifth of the creates are done but answered 502. sference ignores Idempotency-Key,
    so sending them again would create each twice: nopoll counts the ids created in the
    submit's stream instead, finds them all, and sends nothing again."""
    sim, config, source, done = await sference_submit(
        100,
        create_fail_first=0.2,
        create_fail_mode="after",
        complete_after_s=0.3,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "100 submitted, 0 already submitted, 0 rejected" in done.stdout
    assert sim.creations("responses") == 100  # none twice
    posts = sim.creates.received("/v1/responses")
    assert len(posts) == 100  # a lost answer was looked up, never sent again
    streams = {p.body["metadata"]["stream_id"] for p in posts}
    assert len(streams) == 1  # every create of the run in the submit's own stream
    rows = await wait_pg_rows(pg_url, pg_table, 100, timeout=60)
    assert len({r["key"] for r in rows}) == 100
    again = await asyncio.to_thread(nopoll_submit, procs, config, source)
    assert "0 submitted, 100 already submitted" in again.stdout
    assert sim.creations("responses") == 100


async def test_a_sference_create_that_was_not_done_is_sent_again(
    procs, pg_url, pg_table, sference_submit
):
    """The 502s came before anything was created: the stream holds none of them, so each
    is sent again, once."""
    sim, _, _, done = await sference_submit(
        100,
        create_fail_first=0.2,
        create_fail_mode="before",
        complete_after_s=0.3,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "100 submitted" in done.stdout
    assert sim.creations("responses") == 100
    posts = sim.creates.received("/v1/responses")
    assert 100 < len(posts) < 150  # the refused ones once more, no more
    rows = await wait_pg_rows(pg_url, pg_table, 100, timeout=60)
    assert len({r["key"] for r in rows}) == 100


async def test_sference_creates_some_done_some_not_are_reported_in_doubt_never_doubled(
    procs, pg_url, pg_table, sference_submit
):
    """Of the lost answers half were done and half not, and sference cannot say which line
    each id belongs to: nopoll watches the ids that exist, reports those lines in doubt,
    and creates nothing twice."""
    sim, config, source, done = await sference_submit(
        100,
        create_fail_first=0.3,
        create_fail_mode="mixed",
        complete_after_s=0.3,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    doubt = _in_doubt(source)
    posts = sim.creates.received("/v1/responses")
    assert len(posts) == 100  # not one line sent twice
    created = sim.creations("responses")
    assert 0 < 100 - created < len(doubt)  # some of the lines in doubt were created
    rows = await wait_pg_rows(pg_url, pg_table, created, timeout=60)
    assert len({r["key"] for r in rows}) == created  # every create lands, once
    again = await asyncio.to_thread(nopoll_submit, procs, config, source)
    assert again.returncode == 1 and sim.creations("responses") == created  # still in doubt
    assert _in_doubt(source) == doubt


async def test_sigkill_mid_submit_at_sference_then_a_rerun_creates_no_duplicate(
    procs, tmp_path, provider_sim, redis_url, redis_sync_client, pg_url, pg_table
):
    """The run is killed with creates in flight (done at sference, never answered): the
    rerun finds each line marked as sent and settles it against the stream first."""
    sim = provider_sim(dialect="sference", create_delay_s=0.05, complete_after_s=0.2)
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table, "sference")
    source = _lines(tmp_path / "big.jsonl", 400)
    killed = procs.start(
        "submit", "--config", str(config), "sim", str(source), "--concurrency", "20"
    )

    async def halfway():
        return sim.creations("responses") >= 150

    await wait_for(halfway, timeout=60)
    killed.send_signal(signal.SIGKILL)
    killed.wait(10)
    # what the killed run leaves in doubt (marked as sent, no answer recorded) is at most
    # what it had in flight: every answer that came was recorded at once
    digest = file_digest(source)
    sending = set(redis_sync_client.hkeys(sending_key("sim", digest)))
    recorded = set(redis_sync_client.hkeys(record_key("sim", digest)))
    assert len(sending - recorded) <= 20, (len(sending), len(recorded))
    procs.start("worker", "--config", str(config))
    done = await asyncio.to_thread(
        nopoll_submit, procs, config, source, "--wait", "--settle-after", "0.5"
    )
    doubt = _in_doubt(source) if done.returncode else []
    assert len(doubt) <= 20, done.stderr  # at most the creates that were in flight
    assert done.returncode == (1 if doubt else 0), done.stdout + done.stderr
    created = sim.creations("responses")
    assert created == len(sim.creates.received("/v1/responses"))  # none twice
    assert 400 - len(doubt) <= created <= 400
    rows = await wait_pg_rows(pg_url, pg_table, created, timeout=90)
    assert len({r["key"] for r in rows}) == created


@pytest.mark.parametrize("mode", ["after", "before"])
async def test_a_sference_batch_create_whose_answer_was_lost_is_found_or_sent_once_more(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table, mode
):
    """The batch create is answered 502: done (``after``) or not (``before``). nopoll looks
    for a batch of that many requests made since it sent the create: found, it is the
    file's batch; not found, the create is sent once more. One batch either way."""
    sim = provider_sim(
        dialect="sference",
        complete_after_s=0.5,
        create_fail_first=1.0,
        create_fail_status=502,
        create_fail_mode=mode,
    )
    config = _config(tmp_path, sim, redis_url, pg_url, pg_table, "sference")
    procs.start("worker", "--config", str(config))
    source = tmp_path / "batch.jsonl"
    with source.open("wb") as f:
        for i in range(30):
            body = {"model": "m-1", "input": f"q {i}"}
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/responses", "body": body}
            f.write(orjson.dumps(line) + b"\n")
    done = await asyncio.to_thread(
        nopoll_submit, procs, config, source, "--batch", "--wait", "--settle-after", "0.3"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sim.creations("batches") == 1
    assert len(sim.creates.received("/v1/batches")) == (1 if mode == "after" else 2)
    rows = await wait_pg_rows(pg_url, pg_table, 31, timeout=60)
    assert len([r for r in rows if r["kind"] == "batch_row"]) == 30
    again = await asyncio.to_thread(nopoll_submit, procs, config, source, "--batch")
    assert again.returncode == 0 and "already submitted" in again.stdout
    assert sim.creations("batches") == 1
