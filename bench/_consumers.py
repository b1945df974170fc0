"""The client processes of ``bench/consumers.py``: the publisher, the SSE subscribers and
the held ``?wait`` requests, each run as ``consumers.py --publish|--subscribe|--waits``.

Everything here talks to 127.0.0.1 and Redis database 13 only.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import _common as common

TENANTS = 10
_KEY = re.compile(rb'"key":"([^"]*)"')
_WRITERS = 8
"""Concurrent writes in the publisher (a worker runs many jobs at once)."""


def _results_client(timeout_s: float) -> object:
    """The results sink's Redis client, as the worker makes it."""
    from receiver.redis import RedisConnector

    return RedisConnector.from_url(common.REDIS_URL).client("results", at_most_s=timeout_s)


def envelope_fields(i: int) -> tuple[str, str, str]:
    """(key, tenant, provider) of the i-th published envelope."""
    return f"resp_{i:07d}", f"t{i % TENANTS}", f"p{i % 2}"


def subscriber_filter(n: int) -> dict[str, str]:
    if n % 10 == 0:
        return {}
    if n % 10 == 5:
        return {"provider": "p1"}
    return {"tenant": f"t{n % 10}"}


def expected_keys(flt: dict[str, str], total: int) -> set[str]:
    keys = set()
    for i in range(total):
        key, tenant, provider = envelope_fields(i)
        if flt.get("tenant", tenant) == tenant and flt.get("provider", provider) == provider:
            keys.add(key)
    return keys


async def publish(rate: float, total: int, out: Path) -> None:
    """``--publish``: ``total`` envelopes at ``rate`` a second through the real sink."""

    from nopoll.envelope import Envelope, now_rfc3339
    from sinks.results import RESULTS_SINK, ResultsSink, ResultsSinkConfig

    config = ResultsSinkConfig(
        stream_max_entries=1_000_000,
        stream_retention_s=3600,
        latest_ttl_s=600,
    )
    text = "lorem ipsum dolor sit amet " * 12

    def envelope(i: int) -> Envelope:
        key, tenant, provider = envelope_fields(i)
        now = now_rfc3339()
        body = {"id": key, "status": "completed", "output": [{"type": "message", "text": text}]}
        return Envelope(
            provider=provider,
            tenant=tenant,
            kind="response",
            key=key,
            response_id=key,
            status="completed",
            usable=True,
            model="bench-model",
            output_text=text,
            input_tokens=21,
            output_tokens=96,
            received_at=now,
            fetched_at=now,
            body=body,
        )

    envelopes = [envelope(i) for i in range(total)]  # made before the clock starts

    async def writer(sink: ResultsSink, first: int) -> None:
        # like the worker's concurrent jobs: each writes its own envelopes when they are due
        for i in range(first, total, _WRITERS):
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await sink.write([envelopes[i]])

    async with ResultsSink(RESULTS_SINK, config, connect=_results_client) as sink:
        started = time.monotonic()
        await asyncio.gather(*(writer(sink, w) for w in range(_WRITERS)))
        elapsed = time.monotonic() - started
    summary = {"published": total, "seconds": elapsed, "cpu_s": time.process_time()}
    await asyncio.to_thread(out.write_text, json.dumps(summary))


async def publish_big(prefix: str, count: int, size: int = 20_000) -> None:
    """``count`` envelopes of about ``size`` bytes each, 50 to a write, through the sink."""

    from nopoll.envelope import Envelope, now_rfc3339
    from sinks.results import RESULTS_SINK, ResultsSink, ResultsSinkConfig

    config = ResultsSinkConfig(
        stream_max_entries=100_000,
        stream_retention_s=3600,
        latest_ttl_s=600,
    )
    text = "x" * size
    async with ResultsSink(RESULTS_SINK, config, connect=_results_client) as sink:
        for first in range(0, count, 50):
            now = now_rfc3339()
            await sink.write(
                [
                    Envelope(
                        provider="p0",
                        tenant="t0",
                        kind="response",
                        key=f"{prefix}_{i}",
                        status="completed",
                        usable=True,
                        output_text=text,
                        received_at=now,
                        fetched_at=now,
                        body={"id": f"{prefix}_{i}"},
                    )
                    for i in range(first, min(first + 50, count))
                ]
            )


class _SseClient(asyncio.Protocol):
    """One subscriber on a raw socket (httpx costs several times more CPU per chunk here,
    and the clients share the machine with the server): HTTP/1.1 chunked decoding, events
    split on blank lines, each event's key and stream-id time noted on arrival."""

    def __init__(
        self, want: set[str], done: asyncio.Future[None], ready: asyncio.Future[None]
    ) -> None:
        self.want, self.done, self.ready = want, done, ready
        self.raw = b""
        self.headers_seen = False
        self.body = b""
        self.seen: list[bytes] = []
        self.delays: list[float] = []
        self.arrived_ms: list[float] = []
        """When each of :attr:`seen` arrived (wall clock, ms)."""
        self.full_at: float | None = None

    def data_received(self, data: bytes) -> None:
        now_ms = time.time() * 1000
        self.raw += data
        if not self.headers_seen:
            head, sep, rest = self.raw.partition(b"\r\n\r\n")
            if not sep:
                return
            if b" 200 " not in head.split(b"\r\n", 1)[0] and not self.done.done():
                self.done.set_exception(RuntimeError(head[:200].decode(errors="replace")))
                return
            self.headers_seen, self.raw = True, rest
            self.ready.set_result(None)
        raw, body = self.raw, self.body
        while True:  # chunked transfer coding: "<hex size>\r\n<data>\r\n"
            line_end = raw.find(b"\r\n")
            if line_end < 0:
                break
            size = int(raw[:line_end], 16)
            if len(raw) < line_end + 2 + size + 2:
                break
            body += raw[line_end + 2 : line_end + 2 + size]
            raw = raw[line_end + 4 + size :]
        *events, body = body.split(b"\n\n")
        self.raw, self.body = raw, body
        for event in events:
            if event.startswith(b"id: "):
                m = _KEY.search(event, 0, 400)
                if m is not None:
                    self.seen.append(m.group(1))
                    self.delays.append(now_ms - int(event[4 : event.index(b"-")]))
                    self.arrived_ms.append(now_ms)
        if self.full_at is None and len(self.seen) >= len(self.want):
            self.full_at = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def subscribe(port: int, token: str, numbers: list[int], total: int, out: Path) -> None:
    """``--subscribe``: one SSE client per subscriber number, each until it has every
    envelope its filter matches (then 1 s more, to see any extra), or a deadline."""
    from urllib.parse import urlencode

    loop = asyncio.get_running_loop()

    readiness: list[asyncio.Future[None]] = [loop.create_future() for _ in numbers]

    async def one(n: int, ready: asyncio.Future[None]) -> dict[str, object]:
        flt = subscriber_filter(n)
        want = expected_keys(flt, total)
        done: asyncio.Future[None] = loop.create_future()
        transport, client = await loop.create_connection(
            lambda: _SseClient(want, done, ready), "127.0.0.1", port
        )
        query = f"?{urlencode(flt)}" if flt else ""
        transport.write(
            f"GET /v1/results/stream{query} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\nLast-Event-ID: 0-0\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        deadline = time.monotonic() + total / 100 + 120  # bounded whatever happens
        while not done.done() and time.monotonic() < deadline:
            if client.full_at is not None and time.monotonic() - client.full_at > 1.0:
                break
            await asyncio.sleep(0.1)
        transport.close()
        if done.done() and done.exception() is not None:
            raise done.exception()  # type: ignore[misc]
        got = [k.decode() for k in client.seen]
        return {
            "n": n,
            "filter": flt,
            "expected": len(want),
            "received": len(got),
            "missing": len(want - set(got)),
            "duplicates": len(got) - len(set(got)),
            "foreign": len(set(got) - want),
            "delays": [round(d, 2) for d in client.delays],
        }

    tasks = [asyncio.create_task(one(n, r)) for n, r in zip(numbers, readiness, strict=True)]
    await asyncio.wait_for(asyncio.gather(*readiness), 60)
    await asyncio.to_thread(out.with_suffix(".ready").write_text, "ready")
    results = await asyncio.gather(*tasks, return_exceptions=True)
    summary = {
        "subscribers": [r for r in results if isinstance(r, dict)],
        "errors": [repr(r) for r in results if not isinstance(r, dict)],
        "timed_out": 0,
        "cpu_s": time.process_time(),
    }
    await asyncio.to_thread(out.write_text, json.dumps(summary))


async def hold_waits(port: int, token: str, count: int, ready: Path, out: Path) -> None:
    """``--waits``: ``count`` held ``?wait=60`` requests on raw sockets; then each one's
    status and the time its answer came."""

    async def one(i: int) -> tuple[int, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = (
            f"GET /v1/results/p0/wait_{i:05d}?wait=60 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\nConnection: close\r\n\r\n"
        )
        writer.write(request.encode())
        await writer.drain()
        status_line = await reader.readline()
        answered = time.time()
        await reader.read()
        writer.close()
        return int(status_line.split()[1]), answered

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    await asyncio.sleep(3.0)
    early = sum(t.done() for t in tasks)
    await asyncio.to_thread(ready.write_text, json.dumps({"answered_early": early}))
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90)
    answers = [d for d in done if isinstance(d, tuple)]
    summary = {
        "statuses": [s for s, _ in answers],
        "answered": [t for _, t in answers],
        "errors": [repr(d) for d in done if not isinstance(d, tuple)][:5],
    }
    await asyncio.to_thread(out.write_text, json.dumps(summary))


async def land_waits(count: int) -> None:
    """Publish the results the held requests wait for (one sink write)."""

    from nopoll.envelope import Envelope, now_rfc3339
    from sinks.results import RESULTS_SINK, ResultsSink, ResultsSinkConfig

    config = ResultsSinkConfig(
        stream_max_entries=100_000,
        stream_retention_s=3600,
        latest_ttl_s=600,
    )
    now = now_rfc3339()
    envelopes = [
        Envelope(
            provider="p0",
            kind="response",
            key=f"wait_{i:05d}",
            status="completed",
            usable=True,
            received_at=now,
            fetched_at=now,
        )
        for i in range(count)
    ]
    async with ResultsSink(RESULTS_SINK, config, connect=_results_client) as sink:
        await sink.write(envelopes)


def child(argv: list[str], token: str) -> int:
    """Run one client process (on uvloop, what nopoll itself runs on)."""
    import uvloop

    if argv[0] == "--publish":
        uvloop.run(publish(float(argv[1]), int(argv[2]), Path(argv[3])))
    elif argv[0] == "--subscribe":
        numbers = [int(n) for n in argv[2].split(",")]
        uvloop.run(subscribe(int(argv[1]), token, numbers, int(argv[3]), Path(argv[4])))
    else:
        uvloop.run(hold_waits(int(argv[1]), token, int(argv[2]), Path(argv[3]), Path(argv[4])))
    return 0
