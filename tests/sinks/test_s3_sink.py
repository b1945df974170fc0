"""The ``s3`` sink against a real S3 API (moto in server mode, see tests/s3_server.py)."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import boto3
import orjson
import pytest
from pydantic import SecretStr

from nopoll.envelope import (
    BatchRow,
    Envelope,
    batch_summary_envelope,
    envelope_from_response,
    envelope_from_row,
)
from nopoll.exceptions import ConfigError, SinkError
from receiver.demo.simulator import make_response
from sinks.registry import create_sink, validate_sink_config
from sinks.s3.sink import MANIFEST_SCHEMA, S3Sink, S3SinkConfig
from tests.servers import free_port

MIB = 1024 * 1024
MakeSink = Callable[..., Awaitable[S3Sink]]
RECEIVED = "2026-11-29T10:00:00.123Z"


def response_env(i: int) -> Envelope:
    body = make_response(f"resp_{i}", text=f"answer {i}", metadata={"label": "eval"})
    return envelope_from_response(body, provider="sim", received_at=RECEIVED, event_id=f"msg_{i}")


def row_env(batch_id: str, i: int, text: str = "ok") -> Envelope:
    body = make_response(f"resp_{batch_id}_{i}", text=text)
    row = BatchRow(index=i, custom_id=f"row-{i}", status="completed", body=body)
    return envelope_from_row(
        row, provider="sim", batch_id=batch_id, received_at=RECEIVED, event_id="msg_b"
    )


def summary_env(batch_id: str, rows: int) -> Envelope:
    batch = {
        "id": batch_id,
        "object": "batch",
        "status": "completed",
        "request_counts": {"total": rows, "completed": rows, "failed": 0},
    }
    return batch_summary_envelope(
        batch,
        provider="sim",
        batch_id=batch_id,
        received_at=RECEIVED,
        event_id="msg_b",
        counts={"completed": rows},
    )


def chunks(envs: list[Envelope], size: int) -> list[list[Envelope]]:
    return [envs[i : i + size] for i in range(0, len(envs), size)]


@pytest.fixture
def bucket() -> str:
    return f"nopoll-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3(s3_endpoint: str) -> Iterator[Any]:
    """A plain boto3 client to read back what the sink wrote."""
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    yield client
    client.close()


@pytest.fixture
async def make_sink(
    s3_endpoint: str,
    bucket: str,
) -> AsyncIterator[MakeSink]:
    """Factory: an opened S3Sink on the moto server (bucket created), closed afterwards."""
    async with contextlib.AsyncExitStack() as opened:

        async def make(**overrides: Any) -> S3Sink:
            raw = {
                "type": "s3",
                "bucket": bucket,
                "prefix": "nopoll/",
                "endpoint_url": s3_endpoint,
                "create_bucket": True,
                "timeout_s": 10,
                **overrides,
            }
            sink = create_sink("lake", validate_sink_config("lake", raw))
            assert isinstance(sink, S3Sink)
            return await opened.enter_async_context(sink)

        yield make


def keys_under(s3: Any, bucket: str, prefix: str = "") -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", ()))


def get(s3: Any, bucket: str, key: str) -> bytes:
    data: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    return data


async def test_response_object_key_and_bytes(make_sink: MakeSink, s3: Any, bucket: str) -> None:
    sink = await make_sink()
    env = response_env(1)
    await sink.write([env])
    key = "nopoll/sim/responses/resp_1.json"
    assert sink.object_key(env) == key
    assert keys_under(s3, bucket) == [key]
    data = get(s3, bucket, key)
    assert data == orjson.dumps(env.to_dict())
    assert json.loads(data) == env.to_dict()
    await sink.write([response_env(1), response_env(2)])  # a replay overwrites
    assert keys_under(s3, bucket) == [key, "nopoll/sim/responses/resp_2.json"]


async def test_batch_parts_then_manifest_and_rerun(
    make_sink: MakeSink, s3: Any, bucket: str
) -> None:
    sink = await make_sink()
    order: list[str] = []
    put = sink._put

    async def recording_put(key: str, *args: Any, **kwargs: Any) -> None:
        await put(key, *args, **kwargs)
        order.append(key)

    sink._put = recording_put  # type: ignore[method-assign]
    rows = [row_env("batch_1", i) for i in range(850)]
    parts = chunks(rows, 250)
    assert [len(p) for p in parts] == [250, 250, 250, 100]
    prefix = "nopoll/sim/batches/batch_1/"
    part_keys = [f"{prefix}part-{i:05d}.jsonl" for i in range(4)]

    for _ in range(2):  # the second round is a rerun: it overwrites, never duplicates
        for number, part in enumerate(parts):
            await sink.write_batch_part(number, part)
        await sink.write([summary_env("batch_1", 850)])
        assert keys_under(s3, bucket) == sorted([*part_keys, f"{prefix}_manifest.json"])

    assert order == [*part_keys, f"{prefix}_manifest.json"] * 2
    for key, part in zip(part_keys, parts, strict=True):
        lines = get(s3, bucket, key).decode().splitlines()
        assert len(lines) == len(part)
        assert [json.loads(line) for line in lines] == [e.to_dict() for e in part]
        assert s3.head_object(Bucket=bucket, Key=key)["Metadata"] == {"rows": str(len(part))}

    manifest = json.loads(get(s3, bucket, f"{prefix}_manifest.json"))
    summary = summary_env("batch_1", 850)
    assert manifest["schema"] == MANIFEST_SCHEMA
    assert (manifest["provider"], manifest["batch_id"], manifest["status"]) == (
        "sim",
        "batch_1",
        "completed",
    )
    assert manifest["rows"] == 850
    assert manifest["counts"] == {"completed": 850}
    assert [p["key"] for p in manifest["parts"]] == part_keys
    assert [p["rows"] for p in manifest["parts"]] == [250, 250, 250, 100]
    sizes = [s3.head_object(Bucket=bucket, Key=k)["ContentLength"] for k in part_keys]
    assert [p["bytes"] for p in manifest["parts"]] == sizes
    assert {k: v for k, v in manifest["summary"].items() if k != "fetched_at"} == {
        k: v for k, v in summary.to_dict().items() if k != "fetched_at"
    }
    written = {
        k: s3.head_object(Bucket=bucket, Key=k)["LastModified"]
        for k in [*part_keys, f"{prefix}_manifest.json"]
    }
    assert all(written[f"{prefix}_manifest.json"] >= written[k] for k in part_keys)


async def test_multipart_part(make_sink: MakeSink, s3: Any, bucket: str) -> None:
    sink = await make_sink(multipart_threshold_bytes=5 * MIB, multipart_part_bytes=5 * MIB)
    rows = [row_env("batch_big", i, text="x" * 70_000) for i in range(80)]
    body_size = sum(len(orjson.dumps(e.to_dict())) + 1 for e in rows)
    assert 10 * MIB < body_size < 15 * MIB  # three S3 parts: 5, 5 and the rest MiB
    await sink.write_batch_part(0, rows)
    key = "nopoll/sim/batches/batch_big/part-00000.jsonl"
    head = s3.head_object(Bucket=bucket, Key=key)
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload's ETag
    assert head["ContentLength"] == body_size
    assert head["Metadata"] == {"rows": "80"}
    lines = get(s3, bucket, key).splitlines()
    assert [json.loads(line) for line in lines] == [e.to_dict() for e in rows]
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    await sink.write([summary_env("batch_big", 80)])
    manifest = json.loads(get(s3, bucket, "nopoll/sim/batches/batch_big/_manifest.json"))
    assert manifest["parts"] == [{"key": key, "rows": 80, "bytes": body_size}]


async def test_put_claim(make_sink: MakeSink, s3: Any, bucket: str) -> None:
    sink = await make_sink()
    env = row_env("batch_9", 7)
    url = await sink.put_claim(env)
    key = "nopoll/sim/bodies/batch_9/row-7.json"
    assert url == f"s3://{bucket}/{key}"
    assert json.loads(get(s3, bucket, key)) == env.body
    assert sink.object_key(response_env(3)) == "nopoll/sim/responses/resp_3.json"


async def test_manifest_counts_parts_without_metadata(
    make_sink: MakeSink, s3: Any, bucket: str
) -> None:
    """A part written by another tool (no ``rows`` metadata) is counted by its lines."""
    sink = await make_sink()
    await sink.write_batch_part(0, [row_env("b2", i) for i in range(3)])
    body = b"".join(orjson.dumps(row_env("b2", i).to_dict()) + b"\n" for i in range(3, 5))
    s3.put_object(Bucket=bucket, Key="nopoll/sim/batches/b2/part-00001.jsonl", Body=body)
    s3.put_object(Bucket=bucket, Key="nopoll/sim/batches/b2/part-notes.txt", Body=b"x")
    await sink.write([summary_env("b2", 5)])
    manifest = json.loads(get(s3, bucket, "nopoll/sim/batches/b2/_manifest.json"))
    assert [p["rows"] for p in manifest["parts"]] == [3, 2]
    assert manifest["rows"] == 5


async def test_manifest_asks_s3_only_for_parts_written_elsewhere(
    make_sink: MakeSink, s3: Any, bucket: str
) -> None:
    """The row counts of the parts this sink wrote come from its own writes (no HeadObject
    each); a part overwritten since (another ETag) is asked for."""
    sink = await make_sink()
    heads: list[str] = []
    sink.client.meta.events.register(
        "provide-client-params.s3.HeadObject",
        lambda params, **_: heads.append(params["Key"]),
    )
    for n in range(3):
        await sink.write_batch_part(n, [row_env("b5", n * 10 + i) for i in range(4)])
    rewritten = "nopoll/sim/batches/b5/part-00001.jsonl"
    body = b"".join(row_env("b5", 100 + i).to_json() + b"\n" for i in range(2))
    s3.put_object(Bucket=bucket, Key=rewritten, Body=body, Metadata={"rows": "2"})
    await sink.write([summary_env("b5", 10)])
    manifest = json.loads(get(s3, bucket, "nopoll/sim/batches/b5/_manifest.json"))
    assert [p["rows"] for p in manifest["parts"]] == [4, 2, 4]
    assert manifest["rows"] == 10
    assert heads == [rewritten]
    await sink.write([summary_env("b5", 10)])  # again: what it wrote is forgotten, asked now
    assert len(heads) == 4


async def test_batch_rows_need_write_batch_part(make_sink: MakeSink) -> None:
    sink = await make_sink()
    with pytest.raises(SinkError, match="write_batch_part"):
        await sink.write([row_env("b3", 0)])
    with pytest.raises(SinkError, match="one batch's rows"):
        await sink.write_batch_part(0, [row_env("b3", 0), row_env("b4", 1)])


async def test_missing_bucket_is_a_sink_error(s3_endpoint: str, bucket: str) -> None:
    config = S3SinkConfig(bucket=bucket, endpoint_url=s3_endpoint, create_bucket=False)
    sink = S3Sink("lake", config)
    with pytest.raises(SinkError, match="does not exist") as info:
        await sink.open()
    assert bucket in str(info.value) and "create_bucket" in str(info.value)
    await sink.aclose()


async def test_failed_write_names_operation_and_key(
    make_sink: MakeSink, s3: Any, bucket: str
) -> None:
    sink = await make_sink()
    s3.delete_bucket(Bucket=bucket)
    with pytest.raises(SinkError) as info:
        await sink.write([response_env(5)])
    message = str(info.value)
    assert "PutObject" in message and "nopoll/sim/responses/resp_5.json" in message
    assert "NoSuchBucket" in message


async def test_server_down_fails_fast_without_secrets(s3_endpoint: str) -> None:
    config = S3SinkConfig(
        bucket="nopoll-down",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        access_key_id=SecretStr("AKIAEXAMPLEKEYID"),
        secret_access_key=SecretStr("very-secret-value"),
        timeout_s=2,
        max_attempts=2,
    )
    assert "very-secret-value" not in repr(config)
    sink = S3Sink("lake", config)
    started = time.monotonic()
    with pytest.raises(SinkError) as info:
        await sink.open()
    assert time.monotonic() - started < 15
    message = str(info.value)
    assert "HeadBucket" in message and "nopoll-down" in message
    assert "very-secret-value" not in message and "AKIAEXAMPLEKEYID" not in message
    await sink.aclose()
    with pytest.raises(SinkError, match="not open"):
        await sink.write([response_env(1)])


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ({"bucket": "Bad_Bucket"}, "sinks.lake.bucket"),
        ({"bucket": "ab"}, "sinks.lake.bucket"),
        ({"bucket": "192.168.1.1"}, "sinks.lake.bucket"),
        ({"bucket": "ok-bucket", "multipart_part_bytes": 1024}, "sinks.lake.multipart_part_bytes"),
        ({"bucket": "ok-bucket", "prefix": "/abs"}, "sinks.lake.prefix"),
        ({"bucket": "ok-bucket", "endpoint_url": "minio:9000"}, "sinks.lake.endpoint_url"),
        ({"bucket": "ok-bucket", "access_key_id": "x"}, "secret_access_key"),
        ({"bucket": "ok-bucket", "acl": "public"}, "sinks.lake.acl"),
    ],
)
def test_config_validation_names_the_key(raw: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_sink_config("lake", {"type": "s3", **raw})
    assert where in str(info.value)


def test_config_defaults() -> None:
    config = validate_sink_config("lake", {"type": "s3", "bucket": "llm-results"})
    assert isinstance(config, S3SinkConfig)
    assert config.prefix == ""
    assert config.multipart_threshold_bytes == config.multipart_part_bytes == 8 * MIB
    assert config.access_key_id is None and config.create_bucket is False


HOSTILE = {
    "../../x": "..%2F..%2Fx",
    "a/b": "a%2Fb",
    "a b": "a%20b",
    "line\nbreak\r": "line%0Abreak%0D",
    "nul\x00tab\t": "nul%00tab%09",
    "é/ü": "%C3%A9%2F%C3%BC",
    "%41": "%2541",
    "A": "A",
    "..": "..",
    "": "",
    "3": "3",
    "~3": "~~3",
    None: "~3",  # a row without custom_id: its index, 3
    "x" * 600: None,  # over 200 bytes encoded: cut and hashed
    "x" * 600 + "y": None,
}


async def test_claim_keys_of_hostile_custom_ids_are_safe_and_distinct(
    make_sink: MakeSink, s3: Any, bucket: str
) -> None:
    """A custom_id is provider data: percent-encoded into one segment of the claim key, so
    it cannot climb out of the batch's folder, split the key, or meet another row's key."""
    sink = await make_sink()
    envs = []
    for custom_id in HOSTILE:
        body = make_response(f"resp_{len(envs)}", text=repr(custom_id))
        row = BatchRow(index=3, custom_id=custom_id, status="completed", body=body)
        envs.append(
            envelope_from_row(
                row, provider="sim", batch_id="batch_9", received_at=RECEIVED, event_id=None
            )
        )
    keys = [sink.claim_key(e) for e in envs]
    assert keys == [sink.claim_key(e) for e in envs]  # deterministic
    assert len(set(keys)) == len(keys)  # collision-free
    folder = "nopoll/sim/bodies/batch_9/"
    for key, (custom_id, segment) in zip(keys, HOSTILE.items(), strict=True):
        assert key.startswith(folder) and key.endswith(".json"), key
        name = key[len(folder) : -len(".json")]
        assert "/" not in name and name.isascii() and name.isprintable(), key
        assert len(key.encode()) <= 1024
        if segment is not None:
            assert name == segment, (custom_id, name)
        else:
            assert len(name) == 120 + 1 + 64 and name[120] == "!"
    for env in envs:
        url = await sink.put_claim(env)
        assert json.loads(get(s3, bucket, url.removeprefix(f"s3://{bucket}/"))) == env.body
    assert keys_under(s3, bucket) == sorted(keys)


async def test_unsafe_ids_never_shape_a_key(make_sink: MakeSink) -> None:
    sink = await make_sink()
    env = response_env(1)
    env.response_id = env.key = "../../etc"
    for call in (
        lambda: sink.object_key(env),
        lambda: sink.claim_key(env),
        lambda: sink.part_key("sim", "../b", 0),
        lambda: sink.manifest_key("sim", "a/b"),
    ):
        with pytest.raises(SinkError, match="unsafe id"):
            call()
