"""Payload versions through a real Redis and a running worker: a job queued by an older
version (no ``v``) is processed; one of a version this worker does not read is kept as a
dead letter that names it, and the worker goes on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from redis import asyncio as redis_asyncio

from nopoll.envelope import now_rfc3339
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import put_job
from receiver.queue.jobs import FETCH_RESPONSE, FetchResponse, QueuedJob, response_job_id
from tests.e2e.helpers import jsonl_rows, wait_for, worker_started
from tests.servers import running_worker


def _queued(response_id: str, **kwargs: Any) -> QueuedJob:
    payload = {"provider": "sim", "response_id": response_id, "received_at": now_rfc3339()}
    return QueuedJob(FETCH_RESPONSE, response_job_id("sim", response_id), {**payload, **kwargs})


async def test_an_old_payload_lands_and_a_future_one_is_a_dead_letter_after_its_tries(
    make_settings: Any, provider_sim: Any, redis_url: str, tmp_path: Path
) -> None:
    sim = provider_sim()
    sim.add_response("resp_old", text="from an older enqueuer")
    sim.add_response("resp_new", text="from a newer enqueuer")
    sim.add_response("resp_now", text="from this one")
    settings = make_settings(sim.base_url, redis_url=redis_url)
    redis = redis_asyncio.Redis.from_url(redis_url)
    now = FetchResponse(provider="sim", received_at=now_rfc3339(), response_id="resp_now")
    try:
        async with running_worker(settings, redis_url):
            await wait_for(lambda: worker_started(redis_url))
            old = _queued("resp_old")
            assert "v" not in old.kwargs  # the shape workers before versions queued
            assert await put_job(redis, old, expiry_ms=60_000)
            assert await put_job(redis, _queued("resp_new", v=99), expiry_ms=60_000)
            assert await put_job(redis, now.polled(), expiry_ms=60_000)

            async def landed() -> set[str]:
                return {row["key"] for row in jsonl_rows(tmp_path / "results")}

            await wait_for(lambda: _has(landed, {"resp_old", "resp_now"}))
            letters = await wait_for(lambda: DeadLetters(redis).find(key="resp_new"))
        assert await landed() == {"resp_old", "resp_now"}  # the future one never landed
        [letter] = letters
        assert (letter.function, letter.sink, letter.provider) == (FETCH_RESPONSE, "fetch", "sim")
        assert "payload version 99" in letter.error
        assert letter.kwargs["v"] == 99  # kept as queued: a newer worker replays it
        # no live worker reads it: retried with the job's backoff in case one starts (a
        # rolling upgrade whose API pods rolled first), then kept after the last try
        assert letter.attempts == settings.fetch_retry.max_tries
    finally:
        await redis.aclose()


async def _has(read: Any, wanted: set[str]) -> bool:
    return wanted <= await read()
