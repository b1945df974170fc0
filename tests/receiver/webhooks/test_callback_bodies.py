"""Callback bodies on the wire, against a real uvicorn server: an early answer (413, 404,
400) is readable by clients that write their whole body before reading (aiohttp), by
httpx and by curl; what is read of an unwanted body is bounded; a body that does not
arrive whole within ``api.body_timeout_s`` is a 408.
"""

from __future__ import annotations

import asyncio
import io
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import multidict
import orjson
import pytest

from tests.receiver.rawhttp import connect, parse_response
from tests.servers import missing, running_api

MIB = 1024 * 1024
LIMIT = 262_144
BODY_TIMEOUT_S = 0.5


@pytest.fixture
async def server(make_settings, redis_url) -> AsyncIterator[str]:
    settings = make_settings(
        redis_url=redis_url, max_body_bytes=LIMIT, api={"body_timeout_s": BODY_TIMEOUT_S}
    )
    async with running_api(settings, redis_url) as (base, _):
        yield base


@pytest.fixture(scope="module")
def bodies(tmp_path_factory) -> dict[int, Path]:
    """2 MiB and 20 MiB files (curl reads its body from a file)."""
    root = tmp_path_factory.mktemp("bodies")
    out = {}
    for size in (2 * MIB, 20 * MIB):
        path = root / f"{size}.bin"
        path.write_bytes(b"x" * size)
        out[size] = path
    return out


# (path, extra headers, status, words the reason must contain)
EARLY = {
    "413": ("/webhooks/sim", [], 413, str(LIMIT)),
    "404": ("/webhooks/nosuch", [], 404, "unknown provider"),
    "400": ("/webhooks/sim", [("webhook-id", "msg_a"), ("webhook-id", "msg_b")], 400, "differ"),
    # answered by Starlette's routing rather than the webhook endpoint
    "404 path": ("/webhooks/sim/extra", [], 404, "Not Found"),
    "405": ("/healthz", [], 405, "Method Not Allowed"),
}


async def chunks(path: Path) -> AsyncIterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(256 * 1024):
            yield chunk


async def with_aiohttp(url, headers, path: Path, chunked: bool) -> tuple[int, bytes]:
    data = chunks(path) if chunked else io.BytesIO(await asyncio.to_thread(path.read_bytes))
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url, data=data, headers=multidict.CIMultiDict(headers)) as r,
    ):
        return r.status, await r.read()


async def with_httpx(url, headers, path: Path, chunked: bool) -> tuple[int, bytes]:
    content = chunks(path) if chunked else await asyncio.to_thread(path.read_bytes)
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(url, content=content, headers=headers)
        return r.status_code, r.content


async def with_curl(url, headers, path: Path, chunked: bool) -> tuple[int, bytes]:
    curl = shutil.which("curl")
    if curl is None:
        missing("curl is not installed")
    args = [curl, "-sS", "--max-time", "30", "-X", "POST", "--data-binary", f"@{path}"]
    for name, value in [*headers, *([("transfer-encoding", "chunked")] if chunked else [])]:
        args += ["-H", f"{name}: {value}"]
    args += ["-w", "\n%{http_code}", url]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 40)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    body, _, code = out.rpartition(b"\n")
    return int(code), body


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", [2 * MIB, 20 * MIB], ids=["2MiB", "20MiB"])
@pytest.mark.parametrize("case", list(EARLY))
@pytest.mark.parametrize("client", [with_aiohttp, with_httpx, with_curl], ids=lambda c: c.__name__)
async def test_an_early_answer_is_readable_while_the_client_still_sends(
    server, bodies, client, case, size, chunked
):
    path, headers, status, reason = EARLY[case]
    got, body = await client(server + path, headers, bodies[size], chunked)
    assert got == status, body[:200]
    assert reason in orjson.loads(body)["error"]
    async with httpx.AsyncClient(base_url=server, timeout=5) as c:
        assert (await c.get("/healthz")).status_code == 200


async def stream_until_closed(
    base: str, chunk: bytes, pause_s: float, limit_s: float
) -> tuple[int, float, bytes]:
    """POST a body that claims 1 GiB, writing ``chunk`` every ``pause_s`` until the server
    closes the connection (or 1 GiB or ``limit_s`` is reached): (bytes sent, seconds, what
    the server answered)."""
    reader, writer = await connect(base)
    writer.write(
        b"POST /webhooks/sim HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (1024 * MIB)
    )
    answer = asyncio.create_task(reader.read(64 * 1024))
    sent, started = 0, time.monotonic()
    try:
        for _ in range(1024 * MIB // len(chunk)):
            if time.monotonic() - started > limit_s:
                break
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
            if pause_s:
                await asyncio.sleep(pause_s)
            if answer.done() and not answer.exception() and not answer.result():
                break  # EOF before the answer: closed
    except (ConnectionResetError, BrokenPipeError):
        pass
    elapsed = time.monotonic() - started
    try:
        raw = await asyncio.wait_for(answer, 5)
    except (ConnectionResetError, TimeoutError):
        raw = b""
    finally:
        writer.transport.abort()
    return sent, elapsed, raw


@pytest.mark.parametrize(
    ("chunk_kib", "pause_s"),
    [(256, 0.0), (64, 0.05)],
    ids=["fast-sender-hits-the-byte-bound", "slow-sender-hits-the-time-bound"],
)
async def test_draining_an_unwanted_body_is_bounded(server, chunk_kib, pause_s):
    sent, elapsed, raw = await stream_until_closed(
        server, b"x" * chunk_kib * 1024, pause_s, limit_s=15
    )
    assert elapsed < 10, f"server still reading after {elapsed:.1f} s ({sent} bytes)"
    assert sent < 128 * MIB, f"server read {sent // MIB} MiB of an unwanted body"
    if raw:  # the answer, unless the close reset it away
        status, payload = parse_response(raw)
        assert status == 413 and str(LIMIT) in payload["error"]
    async with httpx.AsyncClient(base_url=server, timeout=5) as c:
        assert (await c.get("/healthz")).status_code == 200


@pytest.mark.parametrize("sent", [b"", b'{"id":"evt_1",'], ids=["headers-only", "some-body"])
async def test_a_stalled_body_is_408_while_other_callbacks_are_served(
    server, signed_callback, sent
):
    reader, writer = await connect(server)
    try:
        writer.write(
            b"POST /webhooks/sim HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n" + sent
        )
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=server, timeout=5) as c:
            body, headers = signed_callback("resp_meanwhile")
            r = await c.post("/webhooks/sim", content=body, headers=headers)
            assert r.status_code == 202, r.text
        raw = await asyncio.wait_for(reader.read(), 5)  # the answer, then the server closes
        elapsed = time.monotonic() - started
    finally:
        writer.transport.abort()
    status, payload = parse_response(raw)
    assert status == 408, raw[:200]
    assert f"{BODY_TIMEOUT_S:g} s" in payload["error"]
    assert BODY_TIMEOUT_S * 0.8 < elapsed < 4


async def test_each_stalled_body_gets_its_own_deadline(server):
    """Stalls started 0.2 s apart each end about BODY_TIMEOUT_S after their own start."""

    async def stall() -> tuple[int, float]:
        reader, writer = await connect(server)
        started = time.monotonic()
        try:
            writer.write(b"POST /webhooks/sim HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n")
            raw = await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.transport.abort()
        return parse_response(raw)[0], time.monotonic() - started

    tasks = []
    for _ in range(4):
        tasks.append(asyncio.create_task(stall()))
        await asyncio.sleep(0.2)
    for status, elapsed in await asyncio.gather(*tasks):
        assert status == 408
        assert BODY_TIMEOUT_S * 0.8 < elapsed < BODY_TIMEOUT_S + 1
