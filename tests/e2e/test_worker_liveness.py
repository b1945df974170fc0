"""Work held by a worker process that dies, or stops on SIGTERM, goes to the other worker
within its heartbeat bound (or at once), and lands once: real `nopoll worker` processes,
the provider simulator hanging the dead worker's requests, Postgres rows and S3 objects
counted."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import boto3
import httpx
import orjson
import pytest
import redis as redis_sync
from redis.asyncio import Redis

from receiver.queue._arq import IN_PROGRESS_KEY
from receiver.queue.enqueue import batch_job_id
from receiver.watches.store import WatchStore
from receiver.worker.liveness import WORKERS_KEY
from tests.e2e.helpers import pg_rows, post, wait_for
from tests.s3_server import FAKE_CREDENTIALS
from tests.servers import running_api

pytestmark = pytest.mark.slow

HANG_S = 28.0
"""How long the simulator holds the first GET of each id (below the 30 s read timeout)."""
N = 8
BOUND_S = 12.0
"""A dead worker's work is free within 10 s of its last heartbeat (8 s without a beat, plus
up to one beat of the reaper), plus 2 s to land it on a loaded machine."""
POLL_S = 1.0
"""The watches' normal poll interval (``max_interval_s``)."""
BUCKET = "liveness"


def _config(
    tmp_path: Path, base_url: str, redis_url: str, pg_url: str, table: str, s3_url: str
) -> Path:
    """Two providers on one simulator: ``sim`` (responses, watches) and ``simv`` (valar
    batches); jobs with a long deadline, so only the liveness bound can free them early;
    Postgres and S3 sinks."""
    path = tmp_path / "nopoll.yaml"
    provider = (
        f"    base_url: {base_url}\n    webhook_secrets: ['${{SIM_SECRET}}']\n"
        f"    watch: {{first_poll_s: 0.3, max_interval_s: {POLL_S:g}}}\n"
    )
    slow = "    max_concurrency: 2\n"  # the batch streams 40 rows/s: it is mid-stream for a while
    path.write_text(
        f"redis_url: '{redis_url}'\n"
        f"data_dir: {tmp_path / 'data'}\n"
        "providers:\n"
        f"  sim:\n    dialect: openai\n{provider}"
        # the simulator has no request limit (valar's default budget would be 1/s)
        f"  simv:\n    dialect: valar\n    rate_limit_rps: null\n{provider}{slow}"
        f"sinks:\n  db: {{type: sql, url: '{pg_url}', table: {table}}}\n"
        f"  lake: {{type: s3, bucket: {BUCKET}, endpoint_url: '{s3_url}', region: us-east-1,"
        f" create_bucket: true, access_key_id: {FAKE_CREDENTIALS['AWS_ACCESS_KEY_ID']},"
        f" secret_access_key: {FAKE_CREDENTIALS['AWS_SECRET_ACCESS_KEY']}}}\n"
        "fetch_retry: {max_tries: 5, base_delay_s: 0.1, max_delay_s: 0.5}\n"
        "worker: {poll_delay_s: 0.01, response_job_timeout_s: 60, health_check_interval_s: 1,"
        " shutdown_wait_s: 20}\n"
        "batch: {chunk_size: 50}\n"
    )
    return path


async def _started(procs, index: int) -> None:
    """Worker process ``index`` (its log ``nopoll-<index>.log``) runs its poll loops."""

    async def running() -> bool:
        log = procs.tmp / f"nopoll-{index}.log"
        return log.exists() and log.read_text(errors="replace").count("worker for ") >= 2

    await wait_for(running, timeout=60, interval=0.2)


async def _worker_holding_everything(
    procs,
    tmp_path,
    provider_sim,
    redis_url,
    pg_url,
    pg_table,
    make_settings,
    signed_callback,
    s3_endpoint,
):
    """Worker A holds N watches mid-poll, N response jobs mid-fetch and a batch mid-stream
    (every first GET hangs ``HANG_S``); then worker B starts. (A, its worker id, sim,
    batch, the batch's lock token)."""
    sim = provider_sim()
    for i in range(N):
        sim.add_response(f"resp_watch_{i}", delay_s=HANG_S, delay_times=1)
        sim.add_response(f"resp_job_{i}", delay_s=HANG_S, delay_times=1)
    batch = sim.add_batch("valar", "batch_live", 800, row_delay_s=0.05)
    config = _config(tmp_path, sim.base_url, redis_url, pg_url, pg_table, s3_endpoint)
    worker_a = procs.start("worker", "--config", str(config))
    await _started(procs, 0)
    client = redis_sync.Redis.from_url(redis_url)

    async def beating() -> list[bytes]:
        return client.zrange(WORKERS_KEY, 0, -1)  # A's first beat comes in its start-up

    [a_id] = [w.decode() for w in await wait_for(beating, timeout=30, interval=0.1)]
    settings = make_settings(sim.base_url, redis_url=redis_url)
    valar = settings.providers["sim"].model_copy(update={"dialect": "valar"})
    settings = settings.model_copy(update={"providers": {**settings.providers, "simv": valar}})
    async with running_api(settings, redis_url) as (base, _):
        for i in range(N):
            assert (await post(base, *signed_callback(f"resp_job_{i}"))).status_code == 202
        body, headers = signed_callback("batch_live", event_type="batch.completed")
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{base}/webhooks/simv", content=body, headers=headers)
        assert r.status_code == 202
    store = WatchStore(Redis.from_url(redis_url))
    try:
        ids = [f"resp_watch_{i}" for i in range(N)]
        assert all(await store.register_all("sim", "response", ids, first_poll_in_s=0))
    finally:
        await store.redis.aclose()

    async def all_held() -> bool:
        hanging = all(sim.request_count(f"/v1/responses/{rid}") for rid in _responses())
        return hanging and client.hget("nopoll:batch:simv:batch_live", "c:db") is not None

    await wait_for(all_held, timeout=60, interval=0.1)
    procs.start("worker", "--config", str(config))  # worker B
    await _started(procs, 1)
    lock = client.get(IN_PROGRESS_KEY + batch_job_id("simv", "batch_live"))
    client.close()
    assert lock is not None, "the batch is no longer streaming: make it slower"
    return worker_a, a_id, sim, batch, lock


async def _landed(pg_url: str, table: str, keys: set[str]) -> list[dict] | None:
    rows = await pg_rows(pg_url, table)
    return rows if keys <= {r["key"] for r in rows} else None


async def _all_landed(pg_url: str, table: str, keys: set[str], limit_s: float) -> list[dict]:
    """The rows once every key landed; else fail saying which ones are missing."""
    try:
        return await wait_for(lambda: _landed(pg_url, table, keys), timeout=limit_s, interval=0.5)
    except AssertionError:
        found = {r["key"] for r in await pg_rows(pg_url, table)}
        missing = sorted(keys - found)
        pytest.fail(f"{len(missing)} of {len(keys)} not landed in {limit_s:g} s: {missing[:12]}")


def _responses(kinds: tuple[str, ...] = ("watch", "job")) -> set[str]:
    return {f"resp_{kind}_{i}" for kind in kinds for i in range(N)}


def _expected(batch) -> set[str]:
    """Every row's key, and the summary's (the batch id)."""
    rows = {f"{batch.batch_id}/{batch.custom_id(i) or f'~{i}'}" for i in range(batch.n_rows)}
    return rows | {batch.batch_id}


def _in_s3(s3_url: str) -> tuple[Counter[str], set[str]]:
    """How often each key is in the S3 sink (a response's object; a batch row in any part
    object of its batch, whatever run wrote it) and the batches with a manifest."""
    s3 = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")
    seen: Counter[str] = Counter()
    manifests = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for obj in page.get("Contents", []):
            parts = obj["Key"].split("/")  # <provider>/<kind>/...
            if parts[1] == "responses":
                seen[parts[2].removesuffix(".json")] += 1
            elif parts[-1] == "_manifest.json":
                manifests.add(parts[2])
            elif parts[-1].startswith("part-"):
                body = s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
                seen.update(orjson.loads(line)["key"] for line in body.splitlines())
    return seen, manifests


async def _landed_once(pg: list[dict], s3_url: str, batch, keys: set[str]) -> None:
    """Every key once in SQL; every result once in S3 (once its summary is in), each batch
    row in one part only: no result written twice by two runs."""
    counts = Counter(r["key"] for r in pg)
    assert set(counts) == keys and set(counts.values()) == {1}

    async def s3_done() -> tuple[Counter[str], set[str]] | None:
        seen, manifests = await asyncio.to_thread(_in_s3, s3_url)
        return (seen, manifests) if manifests and set(seen) >= keys - {batch.batch_id} else None

    seen, manifests = await wait_for(s3_done, timeout=30, interval=0.5)
    assert seen == Counter(keys - {batch.batch_id}), [k for k, n in seen.items() if n != 1][:12]
    assert manifests == {batch.batch_id}


async def test_a_sigkilled_workers_watches_jobs_and_batch_resume_within_the_heartbeat_bound(
    procs,
    tmp_path,
    provider_sim,
    redis_url,
    pg_url,
    pg_table,
    make_settings,
    signed_callback,
    s3_endpoint,
):
    worker_a, a_id, sim, batch, held_by_a = await _worker_holding_everything(
        procs,
        tmp_path,
        provider_sim,
        redis_url,
        pg_url,
        pg_table,
        make_settings,
        signed_callback,
        s3_endpoint,
    )
    client = redis_sync.Redis.from_url(redis_url)
    lock = IN_PROGRESS_KEY + batch_job_id("simv", "batch_live")
    responses = _responses()
    rows_before = sum(batch.served.values())
    worker_a.send_signal(signal.SIGKILL)  # polls, fetches and the batch stream all in flight
    worker_a.wait(10)
    last_beat_ms = client.zscore(WORKERS_KEY, a_id)  # Redis's clock, as the reaper reads it
    assert last_beat_ms is not None

    def since_last_beat_s() -> float:
        seconds, micros = client.time()
        return seconds + micros / 1e6 - last_beat_ms / 1000

    async def batch_taken_over() -> bool:
        owner = client.get(lock)
        return owner is not None and owner != held_by_a

    # within 12 s of A's last heartbeat plus the normal poll interval (without liveness:
    # 65 s for the jobs' locks, 315 s for the watches): every response and watch lands,
    # and the batch runs on B
    limit_s = BOUND_S + POLL_S - since_last_beat_s()
    try:
        await _all_landed(pg_url, pg_table, responses, limit_s)
        assert since_last_beat_s() < BOUND_S + POLL_S, procs.logs()
        await wait_for(batch_taken_over, timeout=max(0.1, limit_s), interval=0.05)
        assert since_last_beat_s() < BOUND_S + POLL_S, procs.logs()
    finally:
        client.close()
    # the batch's remaining rows stream at 40 a second after that
    keys = responses | _expected(batch)
    rows = await _all_landed(pg_url, pg_table, keys, 45)
    await _landed_once(rows, s3_endpoint, batch, keys)
    for rid in responses:  # the dead worker's hanging GET, and the one that landed it
        assert sim.request_count(f"/v1/responses/{rid}") == 2, rid
    # the batch resumed after its committed chunks, not from its first row
    assert sum(batch.served.values()) - batch.n_rows < rows_before


async def test_a_sigtermed_worker_hands_its_watches_and_batch_to_the_other_at_once(
    procs,
    tmp_path,
    provider_sim,
    redis_url,
    pg_url,
    pg_table,
    make_settings,
    signed_callback,
    s3_endpoint,
):
    worker_a, _, sim, batch, held_by_a = await _worker_holding_everything(
        procs,
        tmp_path,
        provider_sim,
        redis_url,
        pg_url,
        pg_table,
        make_settings,
        signed_callback,
        s3_endpoint,
    )
    client = redis_sync.Redis.from_url(redis_url)
    lock = IN_PROGRESS_KEY + batch_job_id("simv", "batch_live")
    watches = _responses(("watch",))
    stopped = time.monotonic()
    worker_a.send_signal(signal.SIGTERM)

    async def taken_over() -> bool:
        owner = client.get(lock)
        return owner is not None and owner != held_by_a

    async def watches_landed() -> bool:
        return bool(await _landed(pg_url, pg_table, watches))

    try:
        await wait_for(taken_over, timeout=10, interval=0.05)
        await wait_for(watches_landed, timeout=10 - (time.monotonic() - stopped), interval=0.2)
        assert time.monotonic() - stopped < 10
        keys = _expected(batch) | _responses()
        rows = await _all_landed(pg_url, pg_table, keys, 90)
    finally:
        client.close()
    await _landed_once(rows, s3_endpoint, batch, keys)
    for rid in watches:
        assert sim.request_count(f"/v1/responses/{rid}") == 2, rid
    try:
        assert await asyncio.to_thread(worker_a.wait, 60) == 0, procs.logs()
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker A did not exit after SIGTERM:\n{procs.logs()}")


async def test_a_worker_restarted_in_place_takes_back_its_watches_at_once(
    procs, tmp_path, provider_sim, redis_url, pg_url, pg_table
):
    """302 watched results on two webhook-less providers, ready 2-40 s after they were
    registered; the only worker is SIGKILLed while they are pending and started again at
    once, under the same id (the host and the data_dir). It takes back what its previous
    life held at start, not after its heartbeat bound: every result lands within
    ``max_interval_s`` + 5 s of being ready (p99), the killed worker's polls included."""
    import random

    sim = provider_sim()
    rnd = random.Random(35)
    ids = {name: [f"resp_{name}_{i:03d}" for i in range(151)] for name in ("sim", "sim2")}
    path = tmp_path / "nopoll.yaml"
    provider = (
        f"    dialect: openai\n    base_url: {sim.base_url}\n    rate_limit_rps: null\n"
        "    watch: {first_poll_s: 1, max_interval_s: 8, rate_limit_rps: 200}\n"
    )
    path.write_text(
        f"redis_url: '{redis_url}'\ndata_dir: {tmp_path / 'data'}\nproviders:\n"
        f"  sim:\n{provider}  sim2:\n{provider}"
        f"sinks:\n  db: {{type: sql, url: '{pg_url}', table: {pg_table}}}\n"
        "worker: {poll_delay_s: 0.01, health_check_interval_s: 1}\n"
    )
    first = procs.start("worker", "--config", str(path))
    redis = Redis.from_url(redis_url)
    store = WatchStore(redis)
    started = time.time()
    ready: dict[str, float] = {}
    for name, rids in ids.items():
        for i, rid in enumerate(rids):
            ready[rid] = started + rnd.uniform(2.0, 40.0)
            # a few answer slowly at first: the worker is killed with their polls in flight
            slow = {"delay_s": 4.0, "delay_times": 2} if i % 10 == 0 else {}
            sim.add_response(rid, pending_until=ready[rid], **slow)
        assert all(await store.register_all(name, "response", rids, first_poll_in_s=1))
    await redis.aclose()
    seen: dict[str, float] = {}

    async def look() -> None:
        for row in await pg_rows(pg_url, pg_table):
            seen.setdefault(row["key"], time.time())

    client = redis_sync.Redis.from_url(redis_url)

    def polling() -> int:
        keys = [f"nopoll:watch:{name}:response:{rid}" for name, rids in ids.items() for rid in rids]
        return sum(state == b"polling" for state in (client.hget(k, "state") for k in keys))

    in_flight = 0
    while time.time() < started + 20:  # some landed, many pending, ten or more mid-poll
        await look()
        if time.time() > started + 6 and (in_flight := polling()) >= 10:
            break
        await asyncio.sleep(0.1)
    client.close()
    assert in_flight >= 10, in_flight
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    procs.start("worker", "--config", str(path))  # the same host and data_dir: the same id
    deadline = started + 40 + 8 + 30
    while len(seen) < len(ready) and time.time() < deadline:
        await look()
        await asyncio.sleep(0.1)
    assert len(seen) == len(ready), f"{len(ready) - len(seen)} never landed"
    delays = sorted(seen[rid] - ready[rid] for rid in ready)
    p99 = delays[int(len(delays) * 0.99) - 1]
    assert p99 <= 8 + 5, (p99, delays[-5:])
    assert "restarted: took back" in procs.logs(), procs.logs()[-2000:]
