"""The worker's fetch jobs read exactly the kwargs the API queues, and a response polled
elsewhere lands the way a fetched one does (receiver.worker.fetch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nopoll.kinds import KINDS
from receiver.demo.simulator import make_response
from receiver.metrics import Metrics
from receiver.providers.base import Callback
from receiver.queue.enqueue import FETCH_BATCH, FETCH_RESPONSE
from receiver.queue.jobs import JOBS, FetchBatch, FetchResponse
from receiver.redis import RedisConnector
from receiver.webhooks.endpoint import _job
from receiver.worker.fetch import land_response
from receiver.worker.process import build_workers
from receiver.worker.retry import handler_for
from receiver.worker.state import build_state


def test_the_jobs_read_the_kwargs_the_api_queues() -> None:
    response = _job("sim", "msg_1", Callback("response.completed", KINDS["response"], "resp_1"))
    batch = _job("sim", "msg_2", Callback("batch.completed", KINDS["batch"], "batch_1"))
    assert (response.function, batch.function) == (FETCH_RESPONSE, FETCH_BATCH)
    job = FetchResponse.from_kwargs(response.kwargs)
    assert (job.provider, job.response_id, job.event_id) == ("sim", "resp_1", "msg_1")
    assert job.to_kwargs() == {**response.kwargs, "tenant": "default"}
    queued = FetchBatch.from_kwargs(batch.kwargs)
    assert (queued.batch_id, queued.event_type, queued.from_watch) == (
        "batch_1",
        "batch.completed",
        False,
    )
    assert "event_type" not in queued.runner_kwargs()


async def test_a_polled_response_lands_in_every_sink(
    make_settings: Any, redis_url: str, tmp_path: Path
) -> None:
    settings = make_settings(redis_url=redis_url)
    state = build_state(settings, RedisConnector.from_url(redis_url), Metrics())
    try:
        body = make_response("resp_polled", text="polled")
        landed = await land_response(
            state, "sim", body, event_id=None, received_at="2026-11-29T10:00:00.000Z"
        )
    finally:
        await state.aclose()
    assert landed == {"sinks": 1, "failed": []}
    lines = [
        json.loads(line)
        for path in (tmp_path / "results").glob("sim/*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert [(e["key"], e["output_text"], e["event_id"]) for e in lines] == [
        ("resp_polled", "polled", None)
    ]


async def test_each_queues_worker_runs_the_registered_handler_of_each_of_its_jobs(
    make_settings: Any, redis_url: str
) -> None:
    settings = make_settings(redis_url=redis_url)
    workers = build_workers(
        settings, RedisConnector.from_url(redis_url), Metrics(), handle_signals=False
    )
    try:
        names = [name for w in workers for name in w.functions]
        assert sorted(names) == sorted(JOBS)
        for w in workers:
            for name, function in w.functions.items():
                assert JOBS[name].queue == w.queue_name
                assert function.coroutine is handler_for(name)
                assert function.timeout_s == JOBS[name].rules(settings).arq_timeout_s
    finally:
        for w in workers:
            await w.pool.aclose()
