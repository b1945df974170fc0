"""The HTTP surface through a real uvicorn server and a real Redis: every status code."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
import time

import httpx
import orjson
import pytest
from arq.jobs import deserialize_job

from nopoll.wire import decode_webhook_secret
from receiver.queue._arq import job_deserializer
from receiver.queue.enqueue import JOBS_QUEUE
from tests.servers import ValkeyProcess, running_api


def queued(redis_sync_client) -> list[bytes]:
    return redis_sync_client.zrange(JOBS_QUEUE, 0, -1)


async def test_valid_callback_is_queued_in_arqs_format(api, signed_callback, redis_sync_client):
    body, headers = signed_callback("resp_abc")
    r = await api.post("/webhooks/sim", content=body, headers=headers)
    assert r.status_code == 202, r.text
    assert r.json() == {"status": "queued", "id": "resp_abc"}
    assert queued(redis_sync_client) == [b"resp:sim:resp_abc"]
    raw = redis_sync_client.get("arq:job:resp:sim:resp_abc")
    job = deserialize_job(raw, deserializer=job_deserializer)  # arq's own reader
    assert job.function == "fetch_response"
    assert job.kwargs["response_id"] == "resp_abc"
    assert job.kwargs["event_id"] == headers["webhook-id"]
    assert job.job_try == 1
    # the webhook-id is remembered for at least the 72 h providers retry for (its shard of
    # the dedupe window expires as a whole; test_dedupe.py checks the window itself)
    shards = redis_sync_client.keys("nopoll:seen:*")
    assert shards and all(redis_sync_client.pttl(k) > 72 * 3600 * 1000 for k in shards)


async def test_duplicate_webhook_id_answers_200_and_queues_nothing(
    api, signed_callback, redis_sync_client
):
    body, headers = signed_callback("resp_dup")
    assert (await api.post("/webhooks/sim", content=body, headers=headers)).status_code == 202
    redis_sync_client.delete("arq:job:resp:sim:resp_dup")
    redis_sync_client.zrem(JOBS_QUEUE, "resp:sim:resp_dup")  # as if the job already ran
    again = await api.post("/webhooks/sim", content=body, headers=headers)
    assert again.status_code == 200 and again.json() == {"status": "duplicate"}
    assert queued(redis_sync_client) == []


async def test_simultaneous_duplicates_queue_once(api, signed_callback, redis_sync_client):
    body, headers = signed_callback("resp_race")
    answers = await asyncio.gather(
        *(api.post("/webhooks/sim", content=body, headers=headers) for _ in range(20))
    )
    codes = sorted(a.status_code for a in answers)
    assert codes == [200] * 19 + [202]
    assert queued(redis_sync_client) == [b"resp:sim:resp_race"]


async def test_two_events_for_one_pending_response_fetch_once(
    api, signed_callback, redis_sync_client
):
    b1, h1 = signed_callback("resp_same", event_type="response.incomplete")
    b2, h2 = signed_callback("resp_same")
    r1 = await api.post("/webhooks/sim", content=b1, headers=h1)
    r2 = await api.post("/webhooks/sim", content=b2, headers=h2)
    assert (r1.status_code, r2.status_code) == (202, 202)
    assert r2.json()["status"] == "already_queued"
    assert queued(redis_sync_client) == [b"resp:sim:resp_same"]


@pytest.mark.parametrize(
    "event_type",
    ["response.completed", "response.incomplete", "response.failed", "response.cancelled"],
)
async def test_every_response_event_is_queued(api, signed_callback, redis_sync_client, event_type):
    body, headers = signed_callback("resp_ev", event_type=event_type)
    assert (await api.post("/webhooks/sim", content=body, headers=headers)).status_code == 202
    assert queued(redis_sync_client) == [b"resp:sim:resp_ev"]


async def test_tampered_wrong_secret_stale_future_are_401(api, signed_callback, redis_sync_client):
    body, headers = signed_callback("resp_x")
    cases = {
        "tampered": (body.replace(b"resp_x", b"resp_y"), headers),
        "wrong secret": signed_callback("resp_x", secret="whsec_" + "b3RoZXI=" * 4),
        "stale": signed_callback("resp_x", timestamp=int(time.time()) - 3600),
        "future": signed_callback("resp_x", timestamp=int(time.time()) + 3600),
    }
    for name, (b, h) in cases.items():
        r = await api.post("/webhooks/sim", content=b, headers=h)
        assert r.status_code == 401, name
        assert r.json()["error"], name
    assert queued(redis_sync_client) == []


async def test_rotated_secret_is_accepted(
    make_settings, redis_url, signed_callback, webhook_secret
):
    old = "whsec_" + "b2xkc2VjcmV0" * 3
    settings = make_settings(redis_url=redis_url, secrets_=[webhook_secret, old])
    async with running_api(settings, redis_url) as (base, _), httpx.AsyncClient(base_url=base) as c:
        for name, secret in (("resp_new", webhook_secret), ("resp_old", old)):
            body, headers = signed_callback(name, secret=secret)
            assert (await c.post("/webhooks/sim", content=body, headers=headers)).status_code == 202


@pytest.mark.parametrize("header", ["webhook-id", "webhook-timestamp", "webhook-signature"])
async def test_each_missing_header_is_401(api, signed_callback, header):
    body, headers = signed_callback()
    del headers[header]
    r = await api.post("/webhooks/sim", content=body, headers=headers)
    assert r.status_code == 401
    assert header in r.json()["error"]


@pytest.mark.parametrize("signature", ["garbage", "v1,###", "v1", "v1,"])
async def test_malformed_signature_header_is_401(api, signed_callback, signature):
    body, headers = signed_callback()
    r = await api.post(
        "/webhooks/sim", content=body, headers={**headers, "webhook-signature": signature}
    )
    assert r.status_code == 401


async def test_body_over_the_cap_is_413(api, signed_callback, redis_sync_client):
    big = orjson.dumps({"type": "response.completed", "data": {"id": "r"}, "pad": "x" * 5000})
    body, headers = signed_callback(body=big)
    r = await api.post("/webhooks/sim", content=body, headers=headers)
    assert r.status_code == 413 and "4096" in r.json()["error"]

    async def chunks():
        for _ in range(10):
            yield b"x" * 1000

    chunked = await api.post("/webhooks/sim", content=chunks(), headers=headers)
    assert chunked.status_code == 413
    assert queued(redis_sync_client) == []


@pytest.mark.parametrize(
    "body", [b"not json", b"\xff\xfe\xfd", b"[1,2]", b'{"data":{"id":"r"}}', b'"just a string"']
)
async def test_signed_but_unparseable_is_400(api, signed_callback, webhook_secret, body):
    _, headers = signed_callback(body=b"{}")
    # Sign the exact raw bytes with stdlib hmac (standardwebhooks signs text only).
    key = decode_webhook_secret(webhook_secret)
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    mac = hmac.new(key, signed, hashlib.sha256).digest()
    headers["webhook-signature"] = "v1," + base64.b64encode(mac).decode()
    r = await api.post("/webhooks/sim", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]


@pytest.mark.parametrize(
    "bad_id",
    [
        "../etc/passwd",
        "%2e%2e",
        "..",
        "resp 1",
        "a" * 500,
        "",
        "r/1",
        "résumé",
        None,
        42,
        "resp\n1",
    ],
)
async def test_unsafe_ids_are_400(api, signed_callback, redis_sync_client, bad_id):
    body = orjson.dumps({"id": "evt", "type": "response.completed", "data": {"id": bad_id}})
    body, headers = signed_callback(body=body)
    r = await api.post("/webhooks/sim", content=body, headers=headers)
    assert r.status_code == 400
    assert "data.id" in r.json()["error"]
    assert queued(redis_sync_client) == []


async def test_unknown_event_type_is_202_and_not_queued(api, signed_callback, redis_sync_client):
    body, headers = signed_callback("resp_x", event_type="response.created")
    r = await api.post("/webhooks/sim", content=body, headers=headers)
    assert r.status_code == 202 and r.json()["status"] == "ignored"
    assert queued(redis_sync_client) == []


async def test_unknown_provider_is_404(api, signed_callback):
    body, headers = signed_callback()
    r = await api.post("/webhooks/nosuch", content=body, headers=headers)
    assert r.status_code == 404 and r.json() == {"error": "unknown provider"}


async def test_health_ready_and_metrics(api, signed_callback):
    assert (await api.get("/healthz")).status_code == 200
    ready = await api.get("/readyz")
    assert ready.status_code == 200 and ready.json()["redis"] == "ok"
    body, headers = signed_callback("resp_m")
    await api.post("/webhooks/sim", content=body, headers=headers)
    await api.post("/webhooks/sim", content=body, headers=headers)
    await api.post(
        "/webhooks/sim", content=body, headers={**headers, "webhook-signature": "v1,AAAA"}
    )
    text = (await api.get("/metrics")).text
    assert 'nopoll_callbacks_total{outcome="accepted",provider="sim"} 1.0' in text
    assert 'nopoll_callbacks_total{outcome="duplicate",provider="sim"} 1.0' in text
    assert 'nopoll_callbacks_total{outcome="401",provider="sim"} 1.0' in text
    assert "sk-test-not-a-real-key" not in text


async def test_redis_down_answers_503_then_recovers(make_settings, signed_callback):
    valkey = ValkeyProcess().start()
    try:
        settings = make_settings(redis_url=valkey.url)
        async with (
            running_api(settings, valkey.url) as (base, _),
            httpx.AsyncClient(base_url=base, timeout=15) as client,
        ):
            body, headers = signed_callback("resp_down")
            valkey.stop()
            r = await client.post("/webhooks/sim", content=body, headers=headers)
            assert r.status_code == 503 and "retry" in r.json()["error"]
            assert (await client.get("/readyz")).status_code == 503
            valkey.start()  # same port: the same delivery now succeeds
            r = await client.post("/webhooks/sim", content=body, headers=headers)
            assert r.status_code == 202, r.text
            assert (await client.get("/readyz")).status_code == 200
    finally:
        valkey.stop()


async def test_metrics_show_queue_depth(api, signed_callback):
    for i in range(3):
        body, headers = signed_callback(f"resp_q{i}")
        assert (await api.post("/webhooks/sim", content=body, headers=headers)).status_code == 202
    body, headers = signed_callback("batch_q", event_type="batch.completed")
    assert (await api.post("/webhooks/sim", content=body, headers=headers)).status_code == 202
    text = (await api.get("/metrics")).text
    assert "nopoll_queue_ready_jobs 3.0" in text
    assert "nopoll_queue_deferred_jobs 0.0" in text
    assert "nopoll_batch_queue_jobs 1.0" in text
    assert "nopoll_worker_heartbeat 0.0" in text  # no worker runs
    age = re.search(r"^nopoll_queue_oldest_ready_age_seconds (\S+)$", text, re.M)
    assert age is not None and float(age.group(1)) >= 0


async def test_other_methods_on_the_webhook_route_are_405(api):
    r = await api.get("/webhooks/sim")
    assert r.status_code == 405
