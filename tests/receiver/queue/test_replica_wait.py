"""redis.min_replicas_acked and servers that cannot take writes, at the webhook endpoint
and /readyz, with real servers: a Redis without replicas cannot confirm an enqueue
(503, and /readyz says why); a replica (a demoted primary) answers READONLY (503, and the
connection is dropped, so the next looks for the primary again)."""

from __future__ import annotations

import httpx
import pytest

from receiver.queue.enqueue import Enqueuer, NotReplicated, ReplicaWait
from receiver.queue.jobs import FetchResponse
from receiver.redis import RedisConnector
from tests.servers import ValkeyProcess, running_api


async def test_an_enqueue_no_replica_confirms_is_not_replicated(redis_url) -> None:
    connector = RedisConnector.from_url(redis_url)
    redis = connector.client("api")
    try:
        enqueuer = Enqueuer(
            redis, dedupe_ttl_s=3600, job_expiry_s=3600, replicas=ReplicaWait(1, 50)
        )
        job = FetchResponse.callback("sim", "resp_wait_1", "msg_wait_1")
        with pytest.raises(NotReplicated, match="0 of the 1 replicas"):
            await enqueuer.enqueue(job)
        with pytest.raises(NotReplicated):  # the duplicate too: it waits like the first
            await enqueuer.enqueue(job)
    finally:
        await redis.aclose()
        await connector.aclose()


async def test_callbacks_get_503_and_readyz_says_why_without_the_replicas_asked_for(
    make_settings, redis_url, signed_callback
) -> None:
    settings = make_settings(
        redis_url=redis_url, redis={"min_replicas_acked": 1, "wait_timeout_ms": 50}
    )
    async with running_api(settings, redis_url) as (base, _), httpx.AsyncClient() as http:
        body, headers = signed_callback("resp_wait_2")
        r = await http.post(f"{base}/webhooks/sim", content=body, headers=headers)
        ready = await http.get(f"{base}/readyz")
    assert r.status_code == 503 and "not yet on enough Redis replicas" in r.json()["error"]
    assert ready.status_code == 503
    assert ready.json()["redis"] == "0 replica(s) connected, redis.min_replicas_acked asks for 1"


async def test_a_replica_refuses_writes_with_503_and_readyz_names_its_role(
    make_settings, signed_callback
) -> None:
    primary = ValkeyProcess().start()
    replica = ValkeyProcess(extra=("--replicaof", "127.0.0.1", str(primary.port))).start()
    try:
        settings = make_settings(redis_url=replica.url)
        async with running_api(settings, replica.url) as (base, _), httpx.AsyncClient() as http:
            body, headers = signed_callback("resp_ro_1")
            r = await http.post(f"{base}/webhooks/sim", content=body, headers=headers)
            again = await http.post(f"{base}/webhooks/sim", content=body, headers=headers)
            ready = await http.get(f"{base}/readyz")
        assert [r.status_code, again.status_code] == [503, 503]
        assert "retry later" in r.json()["error"]
        assert ready.status_code == 503 and "it is a slave now" in ready.json()["redis"]
    finally:
        replica.stop()
        primary.stop()
