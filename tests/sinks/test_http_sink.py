"""The ``http`` sink against a real subscriber: a Starlette app under uvicorn on 127.0.0.1
that verifies every POST with the ``standardwebhooks`` package and records it."""

from __future__ import annotations

import asyncio
import email.utils
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from nopoll import exceptions
from nopoll.envelope import Envelope, envelope_from_response
from nopoll.exceptions import ConfigError, SinkError
from receiver import tracing
from receiver.demo.simulator import make_response
from sinks.http import HttpSink, HttpSinkError, SinkRejected
from sinks.registry import create_sink, validate_sink_config
from tests.servers import free_port
from tests.subscriber import Subscriber
from tests.traces import in_memory_traces, named, traceparent_of


def envelope(i: int, provider: str = "sim") -> Envelope:
    body = make_response(f"resp_{i}", metadata={"n": i})
    return envelope_from_response(
        body, provider=provider, received_at="2026-11-29T10:00:00.123Z", event_id=f"msg_{i}"
    )


@pytest.fixture
async def subscriber() -> AsyncIterator[Callable[..., Awaitable[Subscriber]]]:
    """Factory: a started subscriber; every one is stopped at the end of the test."""
    started: list[Subscriber] = []

    async def make(secret: str | bytes, **kwargs: Any) -> Subscriber:
        sub = Subscriber(secret, **kwargs)
        started.append(sub)
        return await sub.start()

    yield make
    for sub in started:
        await sub.stop()


@pytest.fixture
def hooked(subscriber, http_sink, webhook_secret) -> Callable[[], Awaitable[tuple[Any, Any]]]:
    """Factory: (subscriber, http sink posting to it), both with the test's secret."""

    async def make() -> tuple[Subscriber, HttpSink]:
        sub = await subscriber(webhook_secret)
        return sub, await http_sink(sub.url(), webhook_secret)

    return make


@pytest.fixture
async def http_sink() -> AsyncIterator[Callable[..., Awaitable[HttpSink]]]:
    """Factory: an opened ``http`` sink from a raw config entry; closed at the end."""
    sinks: list[HttpSink] = []

    async def make(url: str, secret: str, **config: Any) -> HttpSink:
        raw = {"type": "http", "url": url, "secret": secret, **config}
        sink = create_sink("hook", validate_sink_config("hook", raw))
        assert isinstance(sink, HttpSink)
        sinks.append(sink)
        await sink.open()
        return sink

    yield make
    for sink in sinks:
        await sink.aclose()


async def test_one_envelope_is_one_signed_object(hooked) -> None:
    sub, sink = await hooked()
    env = envelope(1)
    await sink.write([env])
    [got] = sub.deliveries
    assert got.verified
    assert got.payload == env.to_dict()
    assert got.headers["content-type"] == "application/json"
    assert got.headers["user-agent"].startswith("nopoll")
    assert got.headers["webhook-id"].startswith("msg_")
    assert abs(int(got.headers["webhook-timestamp"]) - time.time()) < 60


async def test_the_subscriber_gets_the_writes_traceparent(hooked) -> None:
    sub, sink = await hooked()
    await sink.write([envelope(1)])  # untraced: no header
    with in_memory_traces() as spans:
        with tracing.span("write hook"):
            await sink.write([envelope(2)])
        [write] = named(spans, "write hook")
    untraced, traced = sub.deliveries
    assert "traceparent" not in untraced.headers
    assert traced.verified and traced.headers["traceparent"] == traceparent_of(write)


async def test_many_envelopes_are_arrays_of_batch_size_in_order(hooked) -> None:
    sub, sink = await hooked()
    envs = [envelope(i) for i in range(1200)]
    await sink.write(envs)
    assert all(d.verified for d in sub.deliveries)
    bodies = [d.payload for d in sub.deliveries]
    assert all(isinstance(b, list) for b in bodies)
    assert [len(b) for b in bodies] == [500, 500, 200]
    keys = [row["key"] for body in bodies for row in body]
    assert keys == [e.key for e in envs]  # every key exactly once, in order
    assert bodies[1][0] == envs[500].to_dict()
    assert len({d.headers["webhook-id"] for d in sub.deliveries}) == 3


async def test_batch_size_is_configurable(subscriber, http_sink, webhook_secret) -> None:
    sub = await subscriber(webhook_secret)
    sink = await http_sink(sub.url(), webhook_secret, batch_size=2)
    await sink.write([envelope(i) for i in range(5)])
    shapes = [d.payload if isinstance(d.payload, dict) else len(d.payload) for d in sub.deliveries]
    assert shapes[:2] == [2, 2] and shapes[2]["key"] == "resp_4"  # a lone one is an object


async def test_same_envelopes_carry_the_same_webhook_id(hooked) -> None:
    sub, sink = await hooked()
    envs = [envelope(i) for i in range(3)]
    await sink.write(envs)
    await sink.write(envs)
    await sink.write(envs[::-1])
    await sink.write([envelope(i, provider="other") for i in range(3)])
    ids = [d.headers["webhook-id"] for d in sub.deliveries]
    assert ids[0] == ids[1] == ids[2]
    assert ids[3] != ids[0]  # keys are unique per provider, so the provider is in the id
    assert all(d.verified for d in sub.deliveries)


async def test_raw_secret(subscriber, http_sink) -> None:
    raw = "raw-secret-" + secrets.token_hex(16)
    sub = await subscriber(raw.encode())
    sink = await http_sink(sub.url(), raw)
    await sink.write([envelope(1), envelope(2)])
    [got] = sub.deliveries
    assert got.verified
    assert [r["key"] for r in got.payload] == ["resp_1", "resp_2"]


async def test_wrong_secret_is_rejected_by_the_subscriber(
    subscriber, http_sink, webhook_secret
) -> None:
    sub = await subscriber(webhook_secret)
    sink = await http_sink(sub.url(), "whsec_" + "QUJD" * 8)
    with pytest.raises(SinkRejected) as info:
        await sink.write([envelope(1)])
    assert info.value.status == 401
    assert not sub.deliveries[0].verified


@pytest.mark.parametrize(
    ("status", "rejected"),
    [
        (500, False),
        (503, False),
        (501, False),  # every 5xx
        (408, False),
        (429, False),
        (400, True),
        (404, True),
        (425, True),  # the one "not now" 4xx this sink has always taken as a refusal
    ],
)
async def test_status_classification(
    subscriber, http_sink, webhook_secret, status: int, rejected: bool
) -> None:
    sub = await subscriber(webhook_secret, status=status)
    sink = await http_sink(sub.url(), webhook_secret)
    with pytest.raises(SinkError) as info:
        await sink.write([envelope(1)])
    exc = info.value
    assert isinstance(exc, HttpSinkError) is not rejected  # one SinkRejected, nopoll's
    assert isinstance(exc, SinkRejected) is rejected
    assert isinstance(exc, exceptions.SinkRejected) is rejected  # what the worker checks
    assert exc.status == status and exc.retry_after_s is None
    assert f"HTTP {status}" in str(exc) and f"127.0.0.1:{sub.port}" in str(exc)
    assert exc.sink == "hook"


async def test_429_retry_after_seconds(subscriber, http_sink, webhook_secret) -> None:
    sub = await subscriber(webhook_secret, status=429, headers={"retry-after": "7"})
    sink = await http_sink(sub.url(), webhook_secret)
    with pytest.raises(SinkError) as info:
        await sink.write([envelope(1)])
    assert not isinstance(info.value, SinkRejected)
    assert info.value.retry_after_s == 7  # type: ignore[attr-defined]


async def test_503_retry_after_http_date(subscriber, http_sink, webhook_secret) -> None:
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    sub = await subscriber(webhook_secret, status=503, headers={"retry-after": when})
    sink = await http_sink(sub.url(), webhook_secret)
    with pytest.raises(HttpSinkError) as info:
        await sink.write([envelope(1)])
    assert info.value.retry_after_s is not None and 20 < info.value.retry_after_s <= 31


async def test_redirect_is_not_followed(subscriber, http_sink, webhook_secret) -> None:
    sub = await subscriber(webhook_secret, status=307, headers={"location": "/elsewhere"})
    sink = await http_sink(sub.url(), webhook_secret)
    with pytest.raises(HttpSinkError) as info:
        await sink.write([envelope(1)])
    assert not isinstance(info.value, SinkRejected) and info.value.status == 307
    assert len(sub.deliveries) == 1


@pytest.mark.parametrize("status", [200, 500])
async def test_a_huge_answer_is_not_read_whole(
    subscriber, http_sink, webhook_secret, status: int
) -> None:
    """The sink reads the first few KiB of an answer and closes the connection: a 128 MiB
    answer stops once the socket buffers are full, and the next write still works."""
    huge = 128 * 1024 * 1024
    sub = await subscriber(webhook_secret, status=status, body_bytes=huge)
    sink = await http_sink(sub.url(), webhook_secret)
    for i in range(2):
        if status == 200:
            await sink.write([envelope(i)])
        else:
            with pytest.raises(HttpSinkError, match=f"HTTP {status}.* answer: xxxx"):
                await sink.write([envelope(i)])
    assert len(sub.deliveries) == 2
    await asyncio.sleep(0.2)  # the subscriber has noticed the closed connections
    assert sub.body_sent < huge // 4, sub.body_sent  # two answers, each cut short


async def test_the_start_of_a_refusal_is_in_the_error_without_echoed_secrets(
    subscriber, http_sink, webhook_secret
) -> None:
    token = "tok-" + secrets.token_hex(16)
    answer = f'{{"error": "token {token} is revoked"}}\n\x1b[31m'.encode() + b"z" * 5000
    sub = await subscriber(webhook_secret, status=403, answer=answer)
    sink = await http_sink(sub.url(), webhook_secret, headers={"Authorization": token})
    with pytest.raises(SinkRejected) as info:
        await sink.write([envelope(1)])
    message = str(info.value)
    assert 'refuses it); answer: {"error": "token *** is revoked"} [31mzzz' in message
    assert token not in message and "\x1b" not in message and message.endswith("z...")


async def test_subscriber_down(http_sink, webhook_secret) -> None:
    sink = await http_sink(f"http://127.0.0.1:{free_port()}/hook", webhook_secret)
    with pytest.raises(HttpSinkError) as info:
        await sink.write([envelope(1)])
    assert not isinstance(info.value, SinkRejected)
    assert info.value.status is None and "failed" in str(info.value)


async def test_timeout(subscriber, http_sink, webhook_secret) -> None:
    sub = await subscriber(webhook_secret, delay_s=10)
    sink = await http_sink(sub.url(), webhook_secret, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(HttpSinkError) as info:
        await sink.write([envelope(1)])
    assert time.monotonic() - started < 5
    assert not isinstance(info.value, SinkRejected)
    assert "timed out" in str(info.value)


async def test_retry_after_a_failure_midway_repeats_the_ids(
    subscriber, http_sink, webhook_secret
) -> None:
    """A write whose second POST failed, retried whole: the subscriber sees the first POST
    again under the same webhook-id and can drop it."""
    sub = await subscriber(webhook_secret, script=[200, 500])
    sink = await http_sink(sub.url(), webhook_secret, batch_size=2)
    envs = [envelope(i) for i in range(4)]
    with pytest.raises(HttpSinkError, match=r"POST 2 of 2 \(2 envelopes\)"):
        await sink.write(envs)
    await sink.write(envs)
    ids = [d.headers["webhook-id"] for d in sub.deliveries]
    assert len(ids) == 4 and ids[0] == ids[2] and ids[1] == ids[3] and ids[0] != ids[1]


async def test_secrets_never_in_errors_or_repr(subscriber, http_sink, webhook_secret) -> None:
    token = "tok-" + secrets.token_hex(16)
    path_token = "p-" + secrets.token_hex(8)
    sub = await subscriber(webhook_secret, status=400)
    sink = await http_sink(
        sub.url(f"/hook/{path_token}"),
        webhook_secret,
        headers={"Authorization": f"Bearer {token}", "X-Api-Key": token},
    )
    with pytest.raises(SinkRejected) as rejected:
        await sink.write([envelope(1)])
    assert sub.deliveries[0].headers["authorization"] == f"Bearer {token}"
    assert sub.deliveries[0].headers["x-api-key"] == token
    sub.status = 500
    with pytest.raises(HttpSinkError) as failed:
        await sink.write([envelope(1)])
    down = await http_sink(f"http://127.0.0.1:{free_port()}/{path_token}", webhook_secret)
    with pytest.raises(HttpSinkError) as refused:
        await down.write([envelope(1)])
    errors = [repr(sink), *(f"{e.value} {e.value!r}" for e in (rejected, failed, refused))]
    configs = [repr(sink.config), str(sink.config), sink.config.model_dump_json()]
    secret_body = webhook_secret.removeprefix("whsec_")
    for text in errors + configs:
        assert token not in text and secret_body not in text
    for text in errors:  # errors name the host, not the path (it may be a capability URL)
        assert path_token not in text


def test_config_rejects_non_http_url() -> None:
    with pytest.raises(ConfigError, match=r"sinks\.hook\.url"):
        validate_sink_config("hook", {"type": "http", "url": "ftp://x", "secret": "s"})


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"url": "https://user:pw-secret@example.com/hook"}, "url"),
        ({"url": "not a url"}, "url"),
        ({"secret": "whsec_%%%not-base64"}, "secret"),
        ({"batch_size": 501}, "batch_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"headers": {"webhook-signature": "v1,x"}}, "headers"),
        ({"headers": {"bad name": "x"}}, "headers"),
        ({"headers": {"x-token": "a\r\nb"}}, "headers"),
    ],
)
def test_config_errors_name_the_key(extra: dict[str, Any], key: str) -> None:
    raw = {"type": "http", "url": "https://consumer.example/hook", "secret": "s", **extra}
    with pytest.raises(ConfigError, match=rf"sinks\.hook\.{key}") as info:
        validate_sink_config("hook", raw)
    assert "pw-secret" not in str(info.value) and "%%%" not in str(info.value)


def test_config_defaults() -> None:
    config = validate_sink_config(
        "hook", {"type": "http", "url": "https://consumer.example/hook", "secret": "s"}
    )
    assert config.batch_size == 500 and config.max_connections == 20  # type: ignore[attr-defined]
    assert config.timeout_s == 30.0


async def test_write_nothing_and_write_unopened(subscriber, webhook_secret) -> None:
    sub = await subscriber(webhook_secret)
    config = validate_sink_config(
        "hook", {"type": "http", "url": sub.url(), "secret": webhook_secret}
    )
    sink = create_sink("hook", config)
    with pytest.raises(SinkError, match="not open"):
        await sink.write([envelope(1)])
    async with sink:
        await sink.write([])
    assert sub.deliveries == []
