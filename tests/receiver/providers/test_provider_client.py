"""The provider client: retries, Retry-After, only ever the configured base_url."""

from __future__ import annotations

import time

import httpx
import pytest

from nopoll.exceptions import ProviderError, TransientProviderError
from receiver.config.settings import HttpConfig, ProviderConfig
from receiver.providers import ProviderClient, ResponsesDialect, safe_id

SECRET = "whsec_aGVsbG8gd29ybGQ="


def client(
    base_url: str, transport: httpx.AsyncBaseTransport | None = None, **http: object
) -> ProviderClient:
    cfg = ProviderConfig(
        dialect="openai", base_url=base_url, api_key="sk-test", webhook_secrets=[SECRET]
    )
    return ProviderClient("sim", cfg, HttpConfig(**{"attempts": 3, **http}), transport=transport)


async def test_429_with_retry_after_is_retried_in_place(provider_sim):
    sim = provider_sim(api_key="sk-test")
    sim.add_response("resp_1", fail_times=1, fail_status=429, retry_after=0.3)
    c = client(sim.base_url)
    started = time.monotonic()
    body = await c.get_json("responses/resp_1")  # a batch job's request: retried in place
    assert body["id"] == "resp_1"
    assert time.monotonic() - started >= 0.3
    assert sim.request_count() == 2
    await c.aclose()


async def test_long_retry_after_defers_the_job_instead_of_waiting(provider_sim):
    sim = provider_sim(api_key="sk-test")
    sim.add_response("resp_1", fail_times=5, fail_status=503, retry_after=120)
    c = client(sim.base_url, max_retry_after_s=10)
    with pytest.raises(TransientProviderError) as info:
        await ResponsesDialect(c).fetch_response("resp_1")
    assert info.value.retry_after_s == pytest.approx(120) and info.value.status == 503
    assert sim.request_count() == 1
    await c.aclose()


async def test_500_every_time_gives_up_after_the_attempts(provider_sim):
    sim = provider_sim(api_key="sk-test")
    sim.add_response("resp_1", fail_times=99, fail_status=500)
    c = client(sim.base_url)
    with pytest.raises(TransientProviderError):
        await c.get_json("responses/resp_1")
    assert sim.request_count() == 3
    with pytest.raises(TransientProviderError):  # a response's fetch: its job retries it
        await ResponsesDialect(c).fetch_response("resp_1")
    assert sim.request_count() == 4
    await c.aclose()


async def test_404_and_401_are_permanent_and_not_retried(provider_sim):
    wrong_key = provider_sim(api_key="other-key")
    wrong_key.add_response("resp_1")
    c = client(wrong_key.base_url)
    with pytest.raises(ProviderError) as info:
        await ResponsesDialect(c).fetch_response("resp_1")
    assert not isinstance(info.value, TransientProviderError) and info.value.status == 401
    assert "sk-test" not in str(info.value)
    assert str(info.value).endswith('; the provider said: "bad api key"')
    assert wrong_key.request_count() == 1
    await c.aclose()

    sim = provider_sim(api_key="sk-test")
    c = client(sim.base_url)
    with pytest.raises(ProviderError) as info:
        await ResponsesDialect(c).fetch_response("resp_missing")
    assert not isinstance(info.value, TransientProviderError) and info.value.status == 404
    assert str(info.value) == (
        "sim GET responses/resp_missing (HTTP 404): "
        'unexpected status; the provider said: "no such response"'
    )
    assert sim.request_count() == 1
    await c.aclose()


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (
            400,
            b'{"error": {"message": "Invalid id", "type": "invalid_request_error"}}',
            '"Invalid id"',
        ),
        (404, b'{"error": {"type": "not_found_error"}}', '"not_found_error"'),
        (409, b'{"error": "conflict here"}', '"conflict here"'),
        (410, b'{"detail": "gone"}', '"gone"'),
        (418, b"plain text\r\nX-Fake: log line", '"plain text X-Fake: log line"'),
        (451, b"", None),
        (422, b'{"error": {"message": 42}}', None),
    ],
)
async def test_the_providers_own_reason_is_kept(status, body, said):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body)

    c = client("https://api.example/v1", transport=httpx.MockTransport(handler))
    with pytest.raises(ProviderError) as info:
        await ResponsesDialect(c).fetch_response("resp_1")
    await c.aclose()
    text = str(info.value)
    if said is None:
        assert text.endswith("unexpected status")
    else:
        assert text.endswith(f"unexpected status; the provider said: {said}")


async def test_a_hostile_reason_is_truncated_and_escaped():
    hostile = "first\nERROR forged log line \x1b[31m\u2028" + "x" * 100_000

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": hostile}})

    c = client("https://api.example/v1", transport=httpx.MockTransport(handler), attempts=1)
    with pytest.raises(TransientProviderError) as info:
        await c.get_json("responses/resp_1")
    await c.aclose()
    text = str(info.value)
    assert text.startswith(
        "sim GET responses/resp_1 (HTTP 503): provider busy or failing; "
        'the provider said: "first ERROR forged log line \\u001b[31m x'
    ), text
    assert "\n" not in text and "\x1b" not in text and "\u2028" not in text
    assert len(text) < 450 and text.endswith('\u2026"')


async def test_connection_refused_is_transient():
    c = client("http://127.0.0.1:9/v1", attempts=1)
    with pytest.raises(TransientProviderError, match="connection failed"):
        await ResponsesDialect(c).fetch_response("resp_1")
    await c.aclose()


async def test_redirects_are_not_followed_and_only_base_url_is_called():
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(302, headers={"location": "http://evil.example/steal"})

    c = client("https://api.example/v1", transport=httpx.MockTransport(handler))
    with pytest.raises(ProviderError) as info:
        await ResponsesDialect(c).fetch_response("resp_1")
    assert info.value.status == 302
    assert seen == ["https://api.example/v1/responses/resp_1"]
    await c.aclose()


async def test_answer_for_another_id_or_not_json_is_refused():
    bodies = iter([b'{"id":"resp_other"}', b"<html>", b"[1]"])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=next(bodies))

    c = client("https://api.example/v1", transport=httpx.MockTransport(handler))
    for _ in range(3):
        with pytest.raises(ProviderError):
            await ResponsesDialect(c).fetch_response("resp_1")
    await c.aclose()


@pytest.mark.parametrize("value", ["resp_1", "batch_abc-1.2:x", "a" * 256])
def test_safe_ids(value):
    assert safe_id(value)


@pytest.mark.parametrize("value", ["..", ".", "../x", "%2e%2e", "a b", "a" * 257, "", None, 5, "é"])
def test_unsafe_ids(value):
    assert not safe_id(value)


async def test_the_default_transport_sends_the_headers_and_follows_no_redirect():
    """The hot path's GETs go straight on aiohttp: what a real server sees of them."""
    import asyncio

    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(
            b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:9/steal\r\nContent-Length: 0\r\n\r\n"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    c = client(f"http://127.0.0.1:{port}/v1")
    try:
        with pytest.raises(ProviderError) as info:
            await ResponsesDialect(c).fetch_response("resp_1")
    finally:
        await c.aclose()
        server.close()
        await server.wait_closed()
    assert info.value.status == 302 and len(seen) == 1
    head = seen[0].decode().lower()
    assert head.startswith("get /v1/responses/resp_1 http/1.1\r\n")
    for header in ("authorization: bearer sk-test", "accept: application/json"):
        assert f"\r\n{header}\r\n" in head, head
    assert "accept-encoding: gzip, deflate" in head and "user-agent: nopoll/" in head
