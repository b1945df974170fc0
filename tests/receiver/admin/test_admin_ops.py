"""The operator's admin routes (overview, batches, dead letters and their replay) under a
real server and Redis; the status page reads the same ``Console``."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from redis.asyncio import Redis

from receiver.activity import ActivityRecorder
from receiver.batches.progress import BatchState
from receiver.metrics import Metrics
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import JOBS_QUEUE
from receiver.watches.store import WatchStore
from tests.dead_letters import keep_letter


@pytest.fixture
async def redis(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_every_route_needs_the_admin_token(admin):
    for method, path in [
        ("GET", "/admin/v1/overview"),
        ("GET", "/admin/v1/batches"),
        ("GET", "/admin/v1/feeds"),
        ("GET", "/admin/v1/deadletters"),
        ("POST", "/admin/v1/deadletters/replay"),
    ]:
        r = await admin.request(method, path, headers={"authorization": "Bearer wrong-0123456789"})
        assert r.status_code == 401, path
        assert "admin bearer token" in r.json()["error"]


async def test_dead_letters_page_newest_first_filter_by_sink_and_count(admin, redis):
    store = DeadLetters(redis)
    kept = []
    for i in range(120):
        sink = "files" if i % 3 == 0 else "fetch"
        kept.append(await keep_letter(store, "fetch_response", sink, [f"resp_{i:03d}"]))
    page = (await admin.get("/admin/v1/deadletters", params={"limit": 50})).json()
    assert page["total"] == 120
    assert [d["keys"][0] for d in page["letters"]] == [f"resp_{i:03d}" for i in range(119, 69, -1)]
    assert "kwargs" not in page["letters"][0]  # the work itself is not listed
    last = (await admin.get("/admin/v1/deadletters", params={"offset": 100})).json()
    assert len(last["letters"]) == 20
    files = (await admin.get("/admin/v1/deadletters", params={"sink": "files", "limit": 10})).json()
    assert files["total"] == 40
    assert [d["keys"][0] for d in files["letters"]] == [f"resp_{i:03d}" for i in range(117, 87, -3)]
    second = await admin.get("/admin/v1/deadletters", params={"sink": "files", "offset": 35})
    assert [d["keys"][0] for d in second.json()["letters"]] == [
        f"resp_{i:03d}" for i in (12, 9, 6, 3, 0)
    ]


@pytest.mark.parametrize(
    ("params", "complaint"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "x"}, "whole numbers"),
        ({"offset": "-1"}, "offset"),
        ({"sink": "nope"}, "sink: unknown sink"),
    ],
)
async def test_a_bad_listing_is_400_naming_it(admin, params, complaint):
    r = await admin.get("/admin/v1/deadletters", params=params)
    assert r.status_code == 400 and complaint in r.json()["error"]


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"{", "not valid JSON"),
        (b"{}", "exactly one of ids, sink or all"),
        (b'{"ids": ["a"], "all": true}', "exactly one of ids, sink or all"),
        (b'{"ids": []}', "ids"),
        (b'{"sink": "nope"}', "sink: unknown sink"),
        (b'{"every": true}', "every"),
    ],
)
async def test_a_bad_replay_is_400_naming_it(admin, body, complaint):
    r = await admin.post("/admin/v1/deadletters/replay", content=body)
    assert r.status_code == 400, r.text
    assert complaint in r.json()["error"]


async def test_replay_by_id_and_by_sink_queues_the_work_and_forgets_the_letters(admin, redis):
    store = DeadLetters(redis)
    one = await keep_letter(store, "fetch_response", "fetch", ["resp_1"])
    await keep_letter(store, "fetch_response", "fetch", ["resp_2"])
    await keep_letter(store, "fetch_response", "files", ["resp_3"])
    r = await admin.post("/admin/v1/deadletters/replay", json={"ids": [one.id, "unknown"]})
    assert r.json() == {"replayed": 1, "kept": 0}
    r = await admin.post("/admin/v1/deadletters/replay", json={"sink": "files"})
    assert r.json() == {"replayed": 1, "kept": 0}
    assert [d.keys for d in await store.find()] == [["resp_2"]]
    assert await redis.zcard(JOBS_QUEUE) == 2  # both jobs are queued for a worker
    r = await admin.post("/admin/v1/deadletters/replay", json={"all": True})
    assert r.json() == {"replayed": 1, "kept": 0} and await store.count() == 0


async def test_batches_show_rows_per_sink_rate_eta_and_finished_ones(admin, redis):
    running = BatchState.of(redis, "sim", "batch_run", ttl_s=600, job_expiry_ms=600_000)
    await running.begin(100)
    await running.record_rows(1000)
    for n in range(4):
        await running.record_counts(n, Counter({"completed": 95, "failed": 5}))
    await redis.hset(running.key, "c:files", "2")  # chunks 0..2 written...
    await redis.hset(running.key, "t0", f"{time.time() - 10:.3f}")  # ...in 10 s
    done = BatchState.of(redis, "sim", "batch_done", ttl_s=600, job_expiry_ms=600_000)
    await done.begin(100)
    await done.record_counts(0, Counter({"completed": 7}))
    await done.finish()
    data = (await admin.get("/admin/v1/batches")).json()
    [run] = data["running"]
    assert run["batch_id"] == "batch_run" and run["rows"] == 1000
    assert run["by_sink"] == {"files": 300} and run["fetched"] == 400
    assert run["rows_per_s"] == pytest.approx(30, rel=0.05)
    assert run["eta_s"] == pytest.approx(700 / 30, rel=0.05)
    [fin] = data["finished"]
    assert fin["batch_id"] == "batch_done" and fin["by_status"] == {"completed": 7}
    assert fin["ended_at"] is not None
    await redis.delete(done.key)  # expired: dropped from the listing and the index
    data = (await admin.get("/admin/v1/batches")).json()
    assert data["finished"] == [] and await redis.zcard("nopoll:batchindex") == 1


async def test_overview_sums_every_process_per_minute_and_lists_them(admin, redis):
    processes = []
    for _ in range(2):  # two processes' counters, added into the same minute
        metrics = Metrics()
        metrics.callbacks.labels("sim", "accepted").inc(3)
        metrics.callbacks.labels("sim", "401").inc(1)
        metrics.results.labels("sim", "response").inc(5)
        processes.append(ActivityRecorder(redis, metrics, ["api"]))
    for recorder in processes:
        await recorder.flush()
        await recorder.flush()  # nothing new: nothing added twice
    await WatchStore(redis).register("sim", "response", "resp_w", first_poll_in_s=60)
    data = (await admin.get("/admin/v1/overview")).json()
    now = data["activity"][-1]
    assert len(data["activity"]) == 60 and now["minute"] == int(time.time() // 60) * 60
    assert (now["callbacks"], now["accepted"], now["results"]) == (8, 6, 10)
    assert len(data["processes"]) == 1  # both recorders ran in this one process
    assert data["processes"][0]["roles"] == ["api"]
    assert data["watches"]["sim"]["pending"] == 1
    assert [s["name"] for s in data["sinks"]] == ["files"]
    assert data["sinks"][0]["state"] == "unknown"  # no worker reported it
    assert set(data["queues"]) >= {"nopoll_queue_ready_jobs", "nopoll_batch_queue_jobs"}
