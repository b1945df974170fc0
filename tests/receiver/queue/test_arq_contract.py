"""The arq seam's contract: nopoll writes jobs exactly as arq does, in both directions,
against a real Redis and arq's own Worker."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
import redis as redis_sync
from arq.connections import ArqRedis
from arq.worker import Worker

from receiver.queue._arq import (
    IN_PROGRESS_KEY,
    SUPPORTED,
    SeamWorker,
    arq_pool,
    func,
    job_deserializer,
    job_serializer,
)
from receiver.queue.enqueue import (
    JOBS_QUEUE,
    CallbackJob,
    EnqueueOutcome,
    Enqueuer,
    QueuedJob,
    put_job,
)
from receiver.redis import RedisConnector

QUEUE = JOBS_QUEUE  # put_job routes by function: fetch_response runs on the short-jobs queue
BURST: dict[str, Any] = {
    "queue_name": QUEUE,
    "burst": True,  # run what is queued, then stop
    "poll_delay": 0.01,
    "handle_signals": False,
    "job_serializer": job_serializer,
    "job_deserializer": job_deserializer,
    "keep_result": 0,
}


def _recorder() -> tuple[list[dict[str, Any]], Any]:
    seen: list[dict[str, Any]] = []

    async def fetch_response(ctx: dict[str, Any], **kwargs: Any) -> None:
        seen.append({"try": ctx["job_try"], **kwargs})

    return seen, fetch_response


async def test_a_job_from_nopolls_enqueue_script_runs_on_a_stock_arq_worker(redis_url):
    seen, fetch_response = _recorder()
    client = arq_pool(RedisConnector.from_url(redis_url), queue=QUEUE)
    enqueuer = Enqueuer(client, dedupe_ttl_s=60, job_expiry_s=3600)
    kwargs = {"provider": "p", "response_id": "resp_1", "received_at": "x", "event_id": "e"}
    job = CallbackJob("p", "msg_1", "fetch_response", "resp:p:resp_1", kwargs, QUEUE)
    assert await enqueuer.enqueue(job) is EnqueueOutcome.ENQUEUED
    queued = QueuedJob("fetch_response", "other", {"provider": "p", "response_id": "r2"})
    queued_ok = await put_job(client, queued, expiry_ms=60_000)
    assert queued_ok  # put_job (batch hand-offs, replays) writes the same format
    # stock arq, nothing of nopoll's but the JSON serializer
    worker = Worker([func(fetch_response, name="fetch_response")], redis_pool=client, **BURST)
    await asyncio.wait_for(worker.async_run(), 20)
    await worker.close()
    assert worker.jobs_complete == 2 and worker.jobs_failed == 0
    assert {s["response_id"] for s in seen} == {"resp_1", "r2"}
    assert next(s for s in seen if s["response_id"] == "resp_1")["event_id"] == "e"


async def test_a_job_from_arqs_enqueue_job_runs_on_nopolls_worker(redis_url, redis_sync_client):
    seen, fetch_response = _recorder()
    client: ArqRedis = arq_pool(RedisConnector.from_url(redis_url), queue=QUEUE)
    await client.enqueue_job("fetch_response", _job_id="j1", provider="p", response_id="r1")
    await client.enqueue_job(
        "fetch_response", _job_id="j2", provider="p", response_id="r2", _job_try=3
    )

    class Probe(SeamWorker):
        async def give_up(self, *args: Any) -> None:
            raise AssertionError(f"nothing should be given up: {args}")

    pool = arq_pool(RedisConnector.from_url(redis_url), queue=QUEUE)
    worker = Probe([func(fetch_response, name="fetch_response")], redis_pool=pool, **BURST)
    await asyncio.wait_for(worker.async_run(), 20)
    await worker.close()
    await client.aclose()
    assert sorted((s["response_id"], s["try"]) for s in seen) == [("r1", 1), ("r2", 3)]
    # finished jobs leave nothing behind: no lock, no queue entry
    assert redis_sync_client.zcard(QUEUE) == 0
    assert not redis_sync_client.keys(IN_PROGRESS_KEY + "*")


def test_an_unsupported_arq_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import arq

    monkeypatch.setattr(arq, "VERSION", "0.29.0")
    monkeypatch.delitem(sys.modules, "receiver.queue._arq")
    with pytest.raises(ImportError, match=r"arq >=0\.26,<0\.29; 0\.29\.0 is installed"):
        import receiver.queue._arq  # noqa: F401
    assert SUPPORTED["arq"] == ((0, 26), (0, 29))


def test_the_version_is_checked_before_arq_internals_are_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import arq.worker

    # an arq whose internals moved: the version says why, not a missing name
    monkeypatch.setattr(arq, "VERSION", "0.30.0")
    monkeypatch.delattr(arq.worker, "no_result")
    monkeypatch.delitem(sys.modules, "receiver.queue._arq")
    with pytest.raises(ImportError, match=r"arq >=0\.26,<0\.29; 0\.30\.0 is installed"):
        import receiver.queue._arq  # noqa: F401


def test_the_pins_in_pyproject_match_the_seam() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[3] / "pyproject.toml").read_text()
    assert '"arq>=0.26,<0.29"' in text and '"redis>=5.0,<6"' in text
    assert redis_sync  # the installed redis-py fits the seam (it imported)
