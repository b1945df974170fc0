"""Request bodies of every route but the webhooks' (the ``/ui`` forms, the admin API's
POSTs), on the wire against a real uvicorn server: what is read is counted as it arrives
and stops at the route's cap (413 with a reason, whether or not a Content-Length was
sent), and the body must arrive whole within ``api.body_timeout_s`` (408), as a
callback's must (one reader reads both, so the deadline test runs on the webhook route
too); a client that leaves mid-body is no error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.receiver.rawhttp import connect, parse_response
from tests.servers import running_api

ADMIN = "posts-admin-token-0123456789"
BODY_TIMEOUT_S = 1.0
KIB = 1024
MIB = 1024 * KIB
BEARER = b"authorization: Bearer " + ADMIN.encode() + b"\r\n"
FORM = b"content-type: application/x-www-form-urlencoded\r\n"
JSON = b"content-type: application/json\r\n"

# (path, extra header lines, the route's cap)
ROUTES = {
    "ui-login": ("/ui/login", FORM, 64 * KIB),
    "ui-logout": ("/ui/logout", FORM, 64 * KIB),
    "admin-watches": ("/admin/v1/watches", BEARER + JSON, 4 * MIB),
    "admin-replay": ("/admin/v1/deadletters/replay", BEARER + JSON, 1 * MIB),
    "admin-submit": ("/admin/v1/submit", BEARER + JSON, 64 * MIB),
}
WEBHOOK = ("/webhooks/sim", JSON)


@pytest.fixture
async def server(make_settings, redis_url) -> AsyncIterator[str]:
    settings = make_settings(
        redis_url=redis_url, admin_tokens=[ADMIN], api={"body_timeout_s": BODY_TIMEOUT_S}
    )
    async with running_api(settings, redis_url) as (base, _):
        yield base


def _head(path: str, extra: bytes, framing: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\n%s%s\r\n" % (path.encode(), extra, framing)


async def _still_serving(base: str) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=5) as c:
        assert (await c.get("/healthz")).status_code == 200


@pytest.mark.parametrize("route", [r for r in ROUTES if r != "admin-submit"])
async def test_a_chunked_body_over_the_cap_is_413_before_the_rest_is_sent(server, route):
    """No Content-Length: the server counts what arrives and answers at the cap, while the
    body (never finished here) is still coming; it does not wait for, or keep, the rest."""
    path, extra, cap = ROUTES[route]
    reader, writer = await connect(server)
    answer = asyncio.create_task(reader.read(64 * KIB))
    try:
        writer.write(_head(path, extra, b"transfer-encoding: chunked\r\n"))
        chunk = b"a=" + b"x" * (16 * KIB - 2)
        for _ in range(cap // len(chunk) + 16):  # 256 KiB past the cap, and no last chunk
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                await writer.drain()
        raw = await asyncio.wait_for(answer, BODY_TIMEOUT_S * 0.8)
    finally:
        answer.cancel()
        writer.transport.abort()
    status, payload = parse_response(raw)
    assert status == 413, raw[:300]
    assert payload["error"].startswith(f"body: larger than {cap} bytes")
    await _still_serving(server)


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_declared_length_over_the_cap_is_413_before_anything_is_read(server, route):
    path, extra, cap = ROUTES[route]
    reader, writer = await connect(server)
    try:
        writer.write(_head(path, extra, b"content-length: %d\r\n" % (cap + 1)))
        raw = await asyncio.wait_for(reader.read(64 * KIB), BODY_TIMEOUT_S * 0.8)
    finally:
        writer.transport.abort()
    status, payload = parse_response(raw)
    assert status == 413, raw[:300]
    assert payload["error"].startswith(f"body: larger than {cap} bytes")


@pytest.mark.parametrize("route", [*ROUTES, "webhook"])
async def test_a_trickled_body_is_408_after_the_body_deadline(server, route):
    """A byte every 50 ms never finishes the body: 408 once ``api.body_timeout_s`` has
    passed since the route began reading it, and the connection is closed. The deadline is
    for the whole body, not between chunks."""
    path, extra = WEBHOOK if route == "webhook" else ROUTES[route][:2]
    reader, writer = await connect(server)
    answer = asyncio.create_task(reader.read())
    started = time.monotonic()
    try:
        writer.write(_head(path, extra, b"transfer-encoding: chunked\r\n"))
        for _ in range(120):  # at most 6 s
            if answer.done():
                break
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                writer.write(b"1\r\nx\r\n")
                await writer.drain()
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - started
        raw = await asyncio.wait_for(answer, 5)
    finally:
        answer.cancel()
        writer.transport.abort()
    status, payload = parse_response(raw)
    assert status == 408, raw[:300]
    assert payload["error"] == f"body did not arrive whole within {BODY_TIMEOUT_S:g} s"
    assert BODY_TIMEOUT_S * 0.8 < elapsed < BODY_TIMEOUT_S + 2
    await _still_serving(server)


async def test_without_the_admin_token_the_body_is_not_read_at_all(server):
    """The token is checked before the body: a stranger's body, however large or slow, is
    answered 401 at once (and what follows is dropped, bounded)."""
    reader, writer = await connect(server)
    try:
        writer.write(_head("/admin/v1/submit", JSON, b"transfer-encoding: chunked\r\n"))
        writer.write(b'4\r\n{"a"\r\n')
        raw = await asyncio.wait_for(reader.read(64 * KIB), BODY_TIMEOUT_S * 0.8)
    finally:
        writer.transport.abort()
    status, payload = parse_response(raw)
    assert status == 401 and payload["error"].startswith("Authorization: missing")


async def test_bodies_within_the_caps_are_served_as_before(server):
    async with httpx.AsyncClient(base_url=server, timeout=5) as c:
        page = await c.get("/ui/login")
        assert page.status_code == 200
        r = await c.post("/ui/login", data={"token": "wrong", "csrf": "wrong"})
        assert r.status_code == 403 and "CSRF" in r.text
        r = await c.post(
            "/admin/v1/deadletters/replay",
            json={"ids": ["nothing-here"]},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path",
    [
        "/ui/login",
        "/ui/logout",
        "/admin/v1/watches",
        "/admin/v1/submit",
        "/admin/v1/deadletters/replay",
        "/webhooks/sim",
    ],
)
async def test_a_client_that_leaves_mid_body_is_no_error(make_settings, redis_url, caplog, path):
    """A POST whose client closes the connection after half its body simply ends: nothing
    is logged as an error (nor, but on the webhook route, as a warning), and the server
    serves the next request."""
    settings = make_settings(redis_url=redis_url, admin_tokens=["admin-token-0123456789"])
    caplog.set_level(logging.DEBUG)
    async with running_api(settings, redis_url) as (base, _):
        reader, writer = await connect(base)
        head = (
            f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer admin-token-0123456789\r\n"
            "content-type: application/x-www-form-urlencoded\r\ncontent-length: 1000\r\n\r\n"
        )
        writer.write(head.encode() + b"a" * 500)
        await writer.drain()
        await asyncio.sleep(0.2)  # the server is reading the body
        writer.close()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # no answer, just the end
        await asyncio.sleep(0.2)  # the server has seen the disconnect
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            assert (await client.get("/healthz")).status_code == 200
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    if path.startswith("/webhooks/"):  # a callback cut short is a refused callback: a warning
        loud = [r for r in loud if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [(r.name, r.levelname, r.getMessage(), r.exc_info) for r in loud]
