"""Every sink tells two tenants' results with the same id apart, and keeps the default
tenant's keys, object names and ids exactly as they were."""

from __future__ import annotations

import dataclasses

from nopoll.envelope import Envelope
from sinks.coalesce import _merged
from sinks.http import webhook_id
from sinks.kafka import KafkaSink, KafkaSinkConfig
from sinks.s3._keys import S3Keys


def env(tenant: str = "default", kind: str = "response", key: str = "resp_1") -> Envelope:
    batch = "batch_1" if kind != "response" else None
    return Envelope(
        provider="openai",
        tenant=tenant,
        kind=kind,  # type: ignore[arg-type]
        key=key,
        response_id=key if kind == "response" else None,
        batch_id=batch,
        status="completed",
        usable=True,
        received_at="2026-11-29T10:00:00.123Z",
        fetched_at="2026-11-29T10:00:01.456Z",
    )


def test_s3_objects_of_other_tenants_live_in_their_own_folder() -> None:
    keys = S3Keys("nopoll/", "lake")
    assert keys.object_key(env()) == "nopoll/openai/responses/resp_1.json"
    assert keys.object_key(env("team-a")) == "nopoll/tenant=team-a/openai/responses/resp_1.json"
    summary = env("team-a", "batch", "batch_1")
    assert keys.object_key(summary) == "nopoll/tenant=team-a/openai/batches/batch_1/_manifest.json"
    assert keys.part_key("openai", "batch_1", 0) == "nopoll/openai/batches/batch_1/part-00000.jsonl"
    assert (
        keys.part_key("openai", "batch_1", 0, "team-a")
        == "nopoll/tenant=team-a/openai/batches/batch_1/part-00000.jsonl"
    )
    assert keys.claim_key(env("team-a")) == "nopoll/tenant=team-a/openai/bodies/resp_1.json"
    assert keys.claim_key(env()) == "nopoll/openai/bodies/resp_1.json"


def test_http_webhook_ids_differ_by_tenant_and_stay_for_default() -> None:
    import hashlib

    import orjson

    default = webhook_id([env()])
    assert default == "msg_" + hashlib.sha256(orjson.dumps([["openai", "resp_1"]])).hexdigest()
    assert webhook_id([env("team-a")]) != default
    assert webhook_id([env("team-a")]) != webhook_id([env("team-b")])
    both = [env(), env("team-a")]
    assert webhook_id(both) == webhook_id(both[::-1])


async def test_kafka_message_keys_carry_a_tenant_other_than_default() -> None:
    sink = KafkaSink("bus", KafkaSinkConfig(bootstrap_servers="127.0.0.1:9", topic="t"))
    assert (await sink._record(env()))[0] == b"openai:resp_1"
    assert (await sink._record(env("team-a")))[0] == b"team-a/openai:resp_1"


def test_coalesced_writes_keep_each_tenants_result() -> None:
    first, other = env(), env("team-a")
    later = dataclasses.replace(first, status="failed")
    merged = _merged([([first, other], None), ([later], None)])  # type: ignore[list-item]
    assert sorted((e.tenant, e.status) for e in merged) == [
        ("default", "failed"),
        ("team-a", "completed"),
    ]
