"""Fan-out through real servers: one batch and one oversized response into Postgres, S3
(moto), Kafka (tansu) and JSONL at once, with claim-check from Kafka to S3."""

from __future__ import annotations

import asyncio
import json
import uuid

import boto3
import orjson
import pytest
from redis import asyncio as redis_asyncio

from receiver.queue.deadletter import DeadLetters
from tests.e2e.helpers import jsonl_rows, pg_rows, post, wait_for
from tests.servers import running_api, running_worker
from tests.sinks.helpers import consume


@pytest.fixture
def every_sink(
    make_settings, redis_url, provider_sim, pg_url, pg_table, tmp_path, s3_endpoint, kafka_bootstrap
):
    """(settings, simulator, bucket, topic): provider ``sim`` speaking sference, and
    Postgres, S3, Kafka (claim-checked to S3) and JSONL sinks."""
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    bucket, topic = f"b-{uuid.uuid4().hex[:12]}", f"t.{uuid.uuid4().hex[:12]}"
    sinks = {
        "warehouse": {"type": "sql", "url": pg_url, "table": pg_table},
        "lake": {
            "type": "s3",
            "bucket": bucket,
            "prefix": "nopoll/",
            "endpoint_url": s3_endpoint,
            "region": "us-east-1",
            "create_bucket": True,
        },
        "bus": {
            "type": "kafka",
            "bootstrap_servers": kafka_bootstrap,
            "topic": topic,
            "enable_idempotence": False,
            "max_message_bytes": 80_000,
            "max_batch_size": 80_000,
            "claim_check": "lake",
        },
        "files": {"type": "jsonl", "dir": str(tmp_path / "results")},
    }
    settings = make_settings(
        sim.base_url, redis_url=redis_url, sinks=sinks, batch={"chunk_size": 250, "lease_s": 2}
    )
    provider = settings.providers["sim"].model_copy(update={"dialect": "sference"})
    settings = settings.model_copy(update={"providers": {"sim": provider}})
    return settings, sim, bucket, topic


async def test_batch_and_oversized_response_reach_every_sink(
    every_sink, redis_url, pg_url, pg_table, tmp_path, signed_callback, s3_endpoint, kafka_bootstrap
):
    settings, sim, bucket, topic = every_sink
    batch = sim.add_batch("sference", "batch_fan", 1000, failed_every=10)
    sim.add_response("resp_huge", text="x" * 50_000)  # envelope ~100 KB, ~50 KB without body

    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        assert (
            await post(base, *signed_callback("batch_fan", event_type="batch.completed"))
        ).status_code == 202
        assert (await post(base, *signed_callback("resp_huge"))).status_code == 202

        async def all_rows():
            rows = await pg_rows(pg_url, pg_table)
            return rows if len(rows) == 1002 else None

        await wait_for(all_rows, timeout=60, interval=0.2)
        s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")

        def manifest():
            try:
                obj = s3.get_object(
                    Bucket=bucket, Key="nopoll/sim/batches/batch_fan/_manifest.json"
                )
            except s3.exceptions.NoSuchKey:
                return None
            return json.loads(obj["Body"].read())

        found = await wait_for(lambda: asyncio.to_thread(manifest), timeout=30)
        messages = await consume(kafka_bootstrap, topic, expected=1002, timeout_s=30)

    # S3: four parts of 250 rows, listed in the manifest that came last
    assert [p["key"].rsplit("/", 1)[-1] for p in found["parts"]] == [
        f"part-{i:05d}.jsonl" for i in range(4)
    ]
    assert [p["rows"] for p in found["parts"]] == [250] * 4 and found["rows"] == 1000
    keys = _keys_in_parts(s3, bucket, found["parts"])
    assert keys == {f"batch_fan/{batch.custom_id(i)}" for i in range(1000)}
    response = json.loads(
        s3.get_object(Bucket=bucket, Key="nopoll/sim/responses/resp_huge.json")["Body"].read()
    )
    assert len(response["output_text"]) == 50_000

    # Kafka: every key; the oversized response carries body_ref to S3 instead of its body
    by_key = {m.key.decode(): orjson.loads(m.value) for m in messages}
    assert {k for k in by_key if k.startswith("sim:batch_fan/")} == {f"sim:{k}" for k in keys}
    huge = by_key["sim:resp_huge"]
    assert "body" not in huge and huge["body_ref"].startswith(f"s3://{bucket}/")
    ref_key = huge["body_ref"].removeprefix(f"s3://{bucket}/")
    assert json.loads(s3.get_object(Bucket=bucket, Key=ref_key)["Body"].read())["id"] == "resp_huge"
    assert by_key["sim:batch_fan"]["kind"] == "batch"

    # JSONL: each result once
    assert len(jsonl_rows(tmp_path / "results")) == 1002


def _keys_in_parts(s3, bucket: str, parts: list[dict]) -> set[str]:
    """The envelope keys in the JSONL part objects a manifest lists."""
    keys: set[str] = set()
    for part in parts:
        body = s3.get_object(Bucket=bucket, Key=part["key"])["Body"].read().decode()
        keys |= {json.loads(line)["key"] for line in body.splitlines()}
    return keys


async def test_an_oversize_kafka_message_without_claim_check_is_a_dead_letter_at_once(
    make_settings, redis_url, provider_sim, tmp_path, signed_callback, kafka_bootstrap
):
    """No retry can make a message smaller: without claim_check it becomes a dead letter on
    the first try (not after the sink's retries, minutes later), saying what to set, and
    the other results of the same sink still arrive."""
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    topic = f"t.{uuid.uuid4().hex[:12]}"
    sinks = {
        "bus": {
            "type": "kafka",
            "bootstrap_servers": kafka_bootstrap,
            "topic": topic,
            "enable_idempotence": False,
            "max_message_bytes": 80_000,
            "max_batch_size": 80_000,
        },
        "files": {"type": "jsonl", "dir": str(tmp_path / "results")},
    }
    # the sink's retries as a deployment has them: minutes before a dead letter
    retry = {"max_tries": 12, "base_delay_s": 5, "max_delay_s": 60}
    settings = make_settings(sim.base_url, redis_url=redis_url, sinks=sinks, sink_retry=retry)
    sim.add_response("resp_huge", text="x" * 100_000)
    sim.add_response("resp_small", text="fits")
    redis = redis_asyncio.Redis.from_url(redis_url)
    letters = DeadLetters(redis)

    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        for object_id in ("resp_huge", "resp_small"):
            assert (await post(base, *signed_callback(object_id))).status_code == 202
        found = await wait_for(lambda: letters.find(sink="bus"), timeout=15)
        messages = await consume(kafka_bootstrap, topic, expected=1, timeout_s=15)
        await wait_for(lambda: _rows(tmp_path, 2), timeout=15)
    await redis.aclose()

    [letter] = found
    assert letter.keys == ["resp_huge"] and letter.attempts == 1
    assert "over max_message_bytes (80000)" in letter.error and "claim_check" in letter.error
    assert [m.key for m in messages] == [b"sim:resp_small"]


async def _rows(tmp_path, n: int) -> bool:
    return len(jsonl_rows(tmp_path / "results")) >= n
