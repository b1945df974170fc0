"""Requests written byte for byte, for what httpx and aiohttp refuse to send; h11 reads
the answers."""

from __future__ import annotations

import asyncio

import h11
import orjson


async def connect(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = base.removeprefix("http://").rstrip("/").split(":")
    return await asyncio.open_connection(host, int(port))


async def raw_request(base: str, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """``head`` is the request line and headers without the blank line; a content-length
    and ``connection: close`` are added."""
    reader, writer = await connect(base)
    try:
        writer.write(head + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return parse_response(raw)


def read_response(raw: bytes) -> tuple[int, bytes]:
    """(status, body bytes) of the first response in ``raw``; (0, b"") when there is none."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x")]))
    conn.receive_data(raw)
    status, payload = 0, b""
    for _ in range(1000):
        event = conn.next_event()
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            payload += event.data
        else:
            break
    return status, payload


def parse_response(raw: bytes) -> tuple[int, dict]:
    """(status, JSON body) of the first response in ``raw``; (0, {}) when there is none."""
    status, payload = read_response(raw)
    return status, orjson.loads(payload) if payload else {}
