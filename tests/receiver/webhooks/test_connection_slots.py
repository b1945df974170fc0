"""Connection slots: the room kept for providers is counted in connections, not only in
held requests. A hostile client (a consumer with its token, or anyone on an anonymous
probe path) keeping keep-alive connections busy with a short GET every few seconds, or
opening connections that never send a request, must not make a provider's callbacks 503.
The provider connects from 127.0.0.2, the hostile from 127.0.0.1 (both to 127.0.0.1).
Real uvicorn as ``nopoll api`` runs it (``api.limit_concurrency`` 60), and a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from tests.receiver.helpers import TOKEN, bearer, with_tokens
from tests.servers import running_api

LIMIT = 60
HOSTILE = 59  # every connection but one, as in the review's probe
CALLBACKS = 59


@contextlib.asynccontextmanager
async def busy_keepalive(base: str, path: str, headers: dict[str, str]) -> AsyncIterator[list[int]]:
    """HOSTILE keep-alive connections, each sending ``GET path`` every 3 s; the statuses."""
    statuses: list[int] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=HOSTILE, max_keepalive_connections=HOSTILE)

    async def one(client: httpx.AsyncClient) -> None:
        for _ in range(100):  # bounded: 100 turns of 3 s at most
            with contextlib.suppress(httpx.HTTPError):
                statuses.append((await client.get(path, headers=headers)).status_code)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 3)
            if stop.is_set():
                return

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=10) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(HOSTILE)]
        await asyncio.sleep(1.0)  # every connection open and used once
        try:
            yield statuses
        finally:
            stop.set()
            await asyncio.gather(*tasks)


@contextlib.asynccontextmanager
async def silent_connections(base: str) -> AsyncIterator[list[asyncio.StreamWriter]]:
    """HOSTILE connections that send nothing at all."""
    host, port = base.removeprefix("http://").split(":")
    writers = []
    for _ in range(HOSTILE):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(host, int(port))
            writers.append(writer)
    await asyncio.sleep(0.3)
    try:
        yield writers
    finally:
        for writer in writers:
            writer.close()


async def send_callbacks(base: str, signed_callback: Callable[..., Any]) -> dict[int, int]:
    """CALLBACKS signed callbacks over 4 connections from 127.0.0.2; their statuses."""
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    answers: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=base, transport=transport, timeout=10) as client:
        sem = asyncio.Semaphore(4)

        async def one(i: int) -> None:
            body, headers = signed_callback(f"resp_slot_{i}_{time.monotonic_ns()}")
            async with sem:
                try:
                    r = await client.post("/webhooks/sim", content=body, headers=headers)
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
            answers[status] = answers.get(status, 0) + 1

        await asyncio.gather(*(one(i) for i in range(CALLBACKS)))
    return answers


@pytest.mark.parametrize("who", ["consumer", "anonymous"])
async def test_busy_keepalive_connections_leave_room_for_callbacks(
    make_settings, redis_url, signed_callback, who
):
    settings = with_tokens(make_settings, redis_url, api={"limit_concurrency": LIMIT})
    path, headers = {
        "consumer": ("/v1/results/sim/resp_none", bearer(TOKEN)),
        "anonymous": ("/healthz", {}),
    }[who]
    async with running_api(settings, redis_url) as (base, _):
        async with busy_keepalive(base, path, headers) as hostile:
            answers = await send_callbacks(base, signed_callback)
        assert answers == {202: CALLBACKS}, (answers, sorted(set(hostile)))


async def test_silent_connections_leave_room_for_callbacks(
    make_settings, redis_url, signed_callback
):
    settings = with_tokens(make_settings, redis_url, api={"limit_concurrency": LIMIT})
    async with running_api(settings, redis_url) as (base, metrics):
        async with silent_connections(base):
            answers = await send_callbacks(base, signed_callback)
        assert answers == {202: CALLBACKS}, answers
        # one address held its share (limit - reserve = 45); the rest were refused, counted
        refused = metrics.connection_refusals.labels("client")._value.get()
        assert refused == HOSTILE - (LIMIT - settings.api.reserved_for_webhooks), refused


async def test_a_silent_connection_is_closed_after_the_idle_time(make_settings, redis_url):
    settings = with_tokens(make_settings, redis_url)
    async with running_api(settings, redis_url) as (base, _):
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            started = time.monotonic()
            assert await asyncio.wait_for(reader.read(100), 10) == b""  # closed by the server
            assert 4 <= time.monotonic() - started < 9
        finally:
            writer.close()
