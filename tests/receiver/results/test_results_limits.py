"""Consumers cannot crowd out the providers, nor make the API hold memory or answer a
wrong 503: caps on held requests (``?wait`` and streams) per token and per process, room
kept for ``/webhooks`` below ``api.limit_concurrency``, bounded stream buffers, and
numeric query parameters bounded before they reach Redis. Real uvicorn (with the
settings' ``limit_concurrency``, as ``nopoll api`` runs it) and a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.helpers import Processes, logged_in_as, wait_ready
from tests.receiver.helpers import (
    ADMIN_TOKEN,
    TOKEN,
    TOKEN_A,
    TOKENS,
    bearer,
    envelope,
    sink_for,
    with_tokens,
)
from tests.servers import free_port, running_api

STREAM = "/v1/results/stream"


class Held:
    """Requests held open on raw sockets (streams and waits), closed at the end."""

    def __init__(self, base: str) -> None:
        self.host, port = base.removeprefix("http://").split(":")
        self.port = int(port)
        self.writers: list[asyncio.StreamWriter] = []

    async def open(self, path: str, token: str) -> tuple[int, dict[str, str], bytes]:
        """Send ``GET path``; (status, headers, body start) of an answer that comes within
        0.5 s, or (0, {}, b"") for a request still held (a wait); the connection stays
        open unless it was refused."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        head = f"GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n\r\n"
        writer.write(head.encode())
        await writer.drain()
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
        except TimeoutError:
            self.writers.append(writer)
            return 0, {}, b""
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(
            (n.strip().lower(), v.strip()) for n, _, v in (x.partition(":") for x in lines[1:] if x)
        )
        if status == 200:
            self.writers.append(writer)
            return status, headers, b""
        body = b""
        with contextlib.suppress(TimeoutError):
            body = await asyncio.wait_for(reader.read(2000), 2)
        writer.close()
        return status, headers, body

    async def fill(self, path: str, token: str, most: int) -> tuple[int, list[tuple]]:
        """Open up to ``most`` held requests; (how many were held, the first refusal)."""
        for n in range(most):
            status, headers, body = await self.open(path, token)
            if status not in (0, 200):
                return n, [(status, headers, body)]
        return most, []

    async def aclose(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers.clear()


@contextlib.asynccontextmanager
async def held(base: str) -> AsyncIterator[Held]:
    h = Held(base)
    try:
        yield h
    finally:
        await h.aclose()


def _body(raw: bytes) -> dict:
    match = re.search(rb"\{.*\}", raw, re.S)
    return orjson.loads(match.group(0)) if match else {}


async def test_a_token_at_its_cap_gets_429_with_retry_after(make_settings, redis_url):
    settings = with_tokens(
        make_settings,
        redis_url,
        api={"limit_concurrency": 60},
        results={"max_held_per_token": 4, "max_held": 6},
    )
    async with running_api(settings, redis_url) as (base, _), held(base) as h:
        opened, refused = await h.fill(STREAM, TOKEN, 10)
        assert opened == 4 and refused, (opened, refused)
        status, headers, body = refused[0]
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert "per token" in _body(body)["error"]
        # a wait counts as a held request too
        status, headers, body = await h.open("/v1/results/sim/k?wait=30", TOKEN)
        assert status == 429 and "retry-after" in headers, status
        # another token has its own share, up to the process's cap
        opened, refused = await h.fill("/v1/results/sim/k?wait=30", TOKEN_A, 10)
        assert opened == 2 and refused[0][0] == 429, (opened, refused)
        assert "this API process" in _body(refused[0][2])["error"]
        # a request that is not held is not capped
        async with httpx.AsyncClient(base_url=base, headers=bearer(TOKEN)) as client:
            assert (await client.get("/v1/results/sim/k")).status_code == 404
        # a slot given back is free again
        await h.aclose()
        for _ in range(100):
            status, _, _ = await h.open(STREAM, TOKEN)
            if status == 200:
                break
            await asyncio.sleep(0.05)
        assert status == 200


async def test_consumers_at_their_caps_leave_room_for_signed_callbacks(
    make_settings, redis_url, signed_callback
):
    """59 of 60 connections held by one token made every callback 503; now the consumer
    routes stop below the limit, with room kept for /webhooks."""
    settings = with_tokens(make_settings, redis_url, api={"limit_concurrency": 60})
    async with running_api(settings, redis_url) as (base, _), held(base) as h:
        total = 0
        for token in (TOKEN, TOKEN_A):
            for path in (STREAM, "/v1/results/sim/never?wait=60"):
                opened, _ = await h.fill(path, token, 59 - total)
                total += opened
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            for i in range(5):
                body, headers = signed_callback(f"resp_cap_{i}")
                r = await client.post("/webhooks/sim", content=body, headers=headers)
                assert r.status_code == 202, f"{total} held: {r.status_code} {r.text}"
        assert total < 59


def test_held_request_caps_must_leave_the_webhook_reserve(make_settings, redis_url):
    with pytest.raises(ValueError, match="reserved_for_webhooks"):
        with_tokens(
            make_settings,
            redis_url,
            api={"limit_concurrency": 100, "reserved_for_webhooks": 20},
            results={"max_held": 90},
        )
    with pytest.raises(ValueError, match="reserved_for_webhooks"):
        make_settings(api={"limit_concurrency": 10, "reserved_for_webhooks": 10})
    # unset, the cap follows a small limit down
    small = with_tokens(make_settings, redis_url, api={"limit_concurrency": 20})
    assert small.results.max_held + small.api.reserved_for_webhooks < 20


@pytest.mark.parametrize("wait", ["0.0001", "1e-9", "0.001"])
async def test_a_tiny_wait_is_404_not_503(results_settings, redis_url, wait):
    async with (
        running_api(results_settings(), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, headers=bearer(TOKEN)) as client,
    ):
        r = await client.get("/v1/results/sim/resp_none", params={"wait": wait})
        assert r.status_code == 404 and r.json() == {"error": "not landed"}, r.text


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/admin/v1/watches", {"cursor": "18446744073709551616"}),
        ("/admin/v1/watches", {"cursor": "9" * 40}),
        ("/admin/v1/watches", {"cursor": "9" * 5000}),
        ("/admin/v1/deadletters", {"offset": "9223372036854775807"}),
        ("/admin/v1/deadletters", {"offset": "9" * 40}),
        ("/admin/v1/deadletters", {"offset": "9" * 5000}),
        ("/admin/v1/deadletters", {"limit": "9" * 5000}),
    ],
)
async def test_huge_numbers_in_admin_queries_are_400(admin, path, params):
    r = await admin.get(path, params=params)
    assert r.status_code == 400, (r.status_code, r.text)
    name = next(iter(params))
    assert name in r.json()["error"]


@pytest.mark.parametrize("page", ["9" * 30, "9" * 5000, "²", "0"])
async def test_huge_or_odd_ui_pages_are_not_a_server_error(make_settings, redis_url, page):
    settings = make_settings(redis_url=redis_url, admin_tokens=[ADMIN_TOKEN])
    async with (
        running_api(settings, redis_url) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        await logged_in_as(client, ADMIN_TOKEN)
        r = await client.get("/ui/deadletters", params={"page": page})
        assert r.status_code in (200, 400), (r.status_code, r.text[:300])


# --- readers that stop reading -------------------------------------------------------


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _stalled_reader(port: int, last_event_id: str) -> socket.socket:
    """An SSE client that sends its request, then reads nothing (a tiny receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        f"GET {STREAM} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
        f"last-event-id: {last_event_id}\r\n\r\n".encode()
    )
    return sock


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    p = Processes(tmp_path, dict(os.environ))
    yield p
    p.stop_all()


READERS = 10
BOUND_MB = 4.0
"""What one stalled stream may make the server hold, with room for allocator slack."""


async def test_stalled_stream_readers_hold_bounded_memory(tmp_path, redis_url, procs):
    """Ten SSE clients that read nothing, over ~20 KB envelopes (old ones to catch up on
    and new ones arriving): the API's memory grows by a bounded amount per stream, not by
    what the clients failed to read."""
    port = free_port()
    tokens = "".join(f"  - {{token: {t['token']}}}\n" for t in TOKENS[:1])
    config = tmp_path / "nopoll.yaml"
    config.write_text(
        f"redis_url: '{redis_url}'\ndata_dir: {tmp_path / 'data'}\nlog_level: warning\n"
        f"consumer_tokens:\n{tokens}"
    )
    api = procs.start("api", "--config", str(config), "--port", str(port))
    await asyncio.to_thread(wait_ready, port)
    big = "x" * 20_000
    async with sink_for(redis_url, stream_max_entries=5000) as sink:
        for i in range(0, 400, 50):  # history: 8 MB to catch up on
            await sink.write([envelope(f"old{j}", output_text=big) for j in range(i, i + 50)])
        # warm up: one stream that reads everything once
        headers = {**bearer(TOKEN), "last-event-id": "0-0"}
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
            client.stream("GET", STREAM, headers=headers) as r,
        ):
            got = 0
            async for chunk in r.aiter_bytes():
                got += chunk.count(b"event: result")
                if got >= 400:
                    break
        await asyncio.sleep(0.5)
        before = _rss_mb(api.pid)
        readers = [_stalled_reader(port, "0-0") for _ in range(READERS)]
        try:
            for i in range(0, 400, 50):  # and live ones: 8 MB more
                await sink.write([envelope(f"new{j}", output_text=big) for j in range(i, i + 50)])
            peak = before
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                peak = max(peak, _rss_mb(api.pid))
                await asyncio.sleep(0.1)
        finally:
            for sock in readers:
                sock.close()
    grown = peak - before
    assert grown < READERS * BOUND_MB + 16, f"{grown:.0f} MB more for {READERS} stalled readers"
    assert api.poll() is None
