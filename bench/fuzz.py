"""Fuzzing at scale against a real ``nopoll serve``: generated webhook requests and a batch of
generated result lines, then: no 5xx, no crashed process, every line accounted for.

    python bench/fuzz.py                            # 100,000 requests, 10,000 lines; ~8 min
    python bench/fuzz.py --requests 20000 --lines 2000

The inputs come from the hypothesis strategies in ``tests/fuzzing.py`` (the fuzz tests'
own), generated in ``--procs`` processes:

1. Webhook requests: paths, header sets and bodies of every kind (junk bytes, invalid
   UTF-8, deep nesting, huge fields, NUL, unsafe ids), a fifth correctly signed by the
   ``standardwebhooks`` package so that parsing and queueing past the signature are reached
   too. Sent raw over TCP (32 at a time) to ``nopoll serve`` (API and worker in one process,
   provider ``fz`` of the sference dialect, a Postgres sink). A signed callback with a
   safe id is queued, and the worker fetches it from a provider stand-in that answers every
   ``GET /v1/responses/{id}`` with a generated Responses object (wrong types and all).
2. Dialect rows: a ``results.jsonl`` of ``--lines`` generated sference lines (truncated
   JSON, wrong types, NUL, deep nesting, huge fields, invalid UTF-8), delivered by one signed
   ``batch.completed``. Every line must end as a row in Postgres or as a dead letter naming
   its cause: the expected keys are computed with nopoll's own parser, so duplicate
   ``custom_id`` values (one key, one row) are expected as such.

It prints the answers by status, server errors (target 0), whether the process is the same
one and ready (no crash), and lines expected / landed / dead-lettered / missing (target 0).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    BIN_DIR,
    PG_URL,
    REDIS_URL,
    drop_table,
    flush_bench_db,
    free_port,
    load_note,
    start_process,
    stop_process,
    wait_http,
)

SECRET = "whsec_" + "ZnV6ei1iZW5jaC1zZWNyZXQtMDEyMzQ1Njc4OWFiY2RlZg=="
TABLE = "bench_fuzz"
BATCH = "batch_fuzz"


def _generate(job: tuple[str, int, int]) -> list[Any]:
    """``n`` examples of ``kind`` (``requests``, ``lines`` or ``objects``) from seed ``seed``."""
    from hypothesis import HealthCheck, given, seed, settings

    from tests.fuzzing import dialect_lines, json_values, webhook_requests

    kind, n, at = job
    strategies = {
        "requests": webhook_requests(SECRET),
        "lines": dialect_lines("sference"),
        "objects": json_values,
    }
    strategy = strategies[kind]
    out: list[Any] = []

    @seed(at)
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(value=strategy)
    def collect(value: Any) -> None:
        if len(out) < n:
            out.append(value)

    collect()
    return out


def generated(kind: str, n: int, procs: int) -> list[Any]:
    """``n`` examples of ``kind``, made in ``procs`` processes."""
    per = 2000
    jobs = [(kind, min(per, n - start), 7919 * (start + 1)) for start in range(0, n, per)]
    with multiprocessing.Pool(procs) as pool:
        out: list[Any] = []
        for part in pool.imap(_generate, jobs):
            out.extend(part)
            print(f"  {kind}: {len(out):,} / {n:,}", end="\r", flush=True)
    print()
    return out[:n]


class Provider:
    """The provider stand-in: generated Responses objects and the fuzzed batch, on a real
    HTTP server on 127.0.0.1 (uvicorn in a thread)."""

    def __init__(self, objects: list[Any], lines: list[bytes]) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route

        self.port = free_port()
        self.requests: Counter[str] = Counter()

        async def response(request: Any) -> Response:
            rid = request.path_params["rid"]
            self.requests["responses"] += 1
            output = objects[hash(rid) % len(objects)]
            body = {"id": rid, "object": "response", "status": "completed", "output": output}
            if hash(rid) % 7 == 0:
                body = {"id": rid, "status": output}  # a status of any type
            return Response(orjson.dumps(body), media_type="application/json")

        async def batch(request: Any) -> Response:
            self.requests["batch"] += 1
            obj = {
                "id": BATCH,
                "object": "batch",
                "status": "completed",
                "request_counts": {"total": len(lines)},
            }
            return Response(orjson.dumps(obj), media_type="application/json")

        async def results(request: Any) -> StreamingResponse:
            self.requests["results"] += 1

            async def body() -> Any:
                for line in lines:
                    yield line.replace(b"\n", b" ") + b"\n"

            return StreamingResponse(body(), media_type="application/jsonl")

        app = Starlette(
            routes=[
                Route("/v1/responses/{rid}", response),
                Route(f"/v1/batches/{BATCH}", batch),
                Route(f"/v1/batches/{BATCH}/results.jsonl", results),
            ]
        )
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Provider:
        self.thread.start()
        wait_http(f"http://127.0.0.1:{self.port}/v1/batches/{BATCH}")
        self.requests.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


async def send_all(port: int, requests: list[Any], concurrency: int = 32) -> Counter[int]:
    """Send every request raw (its own connection), ``concurrency`` at a time."""
    from tests.receiver.helpers import _answer, _not_http

    statuses: Counter[int] = Counter()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)

    async def one() -> None:
        while not queue.empty():
            path, headers, body = queue.get_nowait()
            head = b"POST " + path + b" HTTP/1.1\r\nhost: x\r\n"
            head += b"".join(n + b": " + v + b"\r\n" for n, v in headers)
            head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head + body)
                await writer.drain()
                raw = await asyncio.wait_for(reader.read(), 30)
                writer.close()
                status, _ = _answer(raw)
            except (OSError, TimeoutError):
                # reset or timed out; a request that is not valid HTTP (a control byte in a
                # header) is refused by uvicorn's parser, which closes under the unread body
                status = -2 if any(_not_http(v) for _, v in headers) else -1
            statuses[status] += 1

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return statuses


def expected_keys(lines: list[bytes]) -> set[str]:
    from nopoll.envelope import envelope_from_row
    from receiver.providers.sference import parse_line

    keys = set()
    served = [line.replace(b"\n", b" ") for line in lines]
    rows = [line for line in served if line.strip()]  # blank lines are no rows
    for i, line in enumerate(rows):
        row = parse_line(i, line)
        env = envelope_from_row(row, provider="fz", batch_id=BATCH, received_at="x", event_id=None)
        keys.add(env.key)
    return keys


async def landed(pg_url: str) -> set[str]:
    import asyncpg

    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch(
            f"SELECT key FROM {TABLE} WHERE provider = 'fz' AND kind = 'batch_row'"
        )
        summary = await conn.fetchval(
            f"SELECT count(*) FROM {TABLE} WHERE provider = 'fz' AND kind = 'batch'"
        )
    except asyncpg.UndefinedTableError:
        return set()
    finally:
        await conn.close()
    return {r["key"] for r in rows} | ({"<summary>"} if summary else set())


async def dead_letter_keys() -> tuple[set[str], list[str]]:
    from redis.asyncio import Redis

    from receiver.queue.deadletter import DeadLetters

    redis = Redis.from_url(REDIS_URL)
    try:
        letters = await DeadLetters(redis).find()
    finally:
        await redis.aclose()
    keys = {k for d in letters for k in d.keys if k.startswith(f"{BATCH}/")}
    return keys, [d.error for d in letters]


def signed_batch_callback() -> tuple[bytes, list[tuple[bytes, bytes]]]:
    from datetime import UTC, datetime

    from standardwebhooks.webhooks import Webhook

    body = orjson.dumps({"id": "evt_b", "type": "batch.completed", "data": {"id": BATCH}})
    now = datetime.now(tz=UTC)
    signature = Webhook(SECRET).sign("msg_batch_fuzz", now, body.decode())
    return body, [
        (b"webhook-id", b"msg_batch_fuzz"),
        (b"webhook-timestamp", str(int(now.timestamp())).encode()),
        (b"webhook-signature", signature.encode()),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--drain", type=float, default=300, help="seconds to wait for rows")
    args = parser.parse_args()

    started = time.monotonic()
    print(f"generating with hypothesis in {args.procs} processes ...", flush=True)
    requests = generated("requests", args.requests, args.procs)
    lines = [
        orjson.dumps(x) if not isinstance(x, bytes) else x
        for x in generated("lines", args.lines, args.procs)
    ]
    objects = generated("objects", 500, args.procs)
    print(f"  generated in {time.monotonic() - started:.0f} s")
    flush_bench_db()
    asyncio.run(drop_table(TABLE))

    tmp = Path(tempfile.mkdtemp(prefix="nopoll-bench-fuzz-"))
    failed = False
    with Provider(objects, lines) as provider:
        config = tmp / "nopoll.yaml"
        config.write_text(
            f"redis_url: {REDIS_URL}\n"
            f"data_dir: {tmp / 'data'}\n"
            "log_level: warning\n"
            "max_body_bytes: 65536\n"
            "providers:\n"
            "  fz:\n"
            "    dialect: sference\n"
            f"    base_url: http://127.0.0.1:{provider.port}/v1\n"
            f"    webhook_secrets: ['{SECRET}']\n"
            f"sinks:\n  db: {{type: sql, url: '{PG_URL}', table: {TABLE}}}\n"
            "fetch_retry: {max_tries: 3, base_delay_s: 0.1, max_delay_s: 0.5}\n"
            "batch: {chunk_size: 500}\n"
        )
        port = free_port()
        log = tmp / "serve.log"
        proc = start_process(
            [str(BIN_DIR / "nopoll"), "serve", "--config", str(config), "--port", str(port)],
            log_path=log,
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz", proc=proc, log_path=log)
            print(f"sending {len(requests):,} generated webhook requests ...", flush=True)
            t0 = time.monotonic()
            statuses = asyncio.run(
                send_all(
                    port,
                    [(p.replace(b"/webhooks/sim", b"/webhooks/fz"), h, b) for p, h, b in requests],
                )
            )
            took = time.monotonic() - t0
            errors = sum(n for s, n in statuses.items() if s >= 500 or s == -1)
            print(
                f"  {len(requests):,} in {took:.0f} s ({len(requests) / took:,.0f}/s): "
                + ", ".join(f"{n:,} x {s}" for s, n in sorted(statuses.items()))
            )
            print(
                f"  server errors (5xx, resets, no answer): {errors} (target 0); "
                f"-2: not valid HTTP, cut by uvicorn's parser: {statuses.get(-2, 0)}"
            )
            failed |= errors > 0

            print(f"a batch of {len(lines):,} generated sference lines ...", flush=True)
            body, headers = signed_batch_callback()
            answer = asyncio.run(send_all(port, [(b"/webhooks/fz", headers, body)], 1))
            assert answer == Counter({202: 1}), answer
            expected = expected_keys(lines)
            deadline = time.monotonic() + args.drain
            seen: set[str] = set()
            dead: set[str] = set()
            errors_text: list[str] = []
            for _ in range(int(args.drain / 2) + 1):
                seen = asyncio.run(landed(PG_URL))
                dead, errors_text = asyncio.run(dead_letter_keys())
                if "<summary>" in seen or time.monotonic() > deadline:
                    break
                time.sleep(2)
            rows = seen - {"<summary>"}
            # Postgres refuses U+0000: nopoll stores it as U+FFFD (keys included)
            stored = {k.replace("\x00", "\ufffd") for k in expected}
            collided = len(expected) - len(stored)
            expected = stored
            missing = expected - rows - dead
            if missing:
                print(f"  e.g. missing: {[k[:80] for k in sorted(missing)[:5]]}")
            blank = sum(1 for line in lines if not line.replace(b"\n", b" ").strip())
            print(
                f"  lines {len(lines):,} ({blank} blank: no row), distinct keys expected "
                f"{len(expected):,} (the rest share a custom_id; {collided} differ only by NUL "
                "against U+FFFD and share a Postgres row), "
                f"rows {len(rows):,}, dead-lettered {len(dead):,}, missing {len(missing):,} "
                f"(target 0), summary {'landed' if '<summary>' in seen else 'MISSING'}"
            )
            unexplained = [e for e in errors_text if not e.strip()]
            print(f"  dead letters: {len(errors_text)} in all, {len(unexplained)} without a cause")
            failed |= bool(missing) or "<summary>" not in seen or bool(unexplained)
            alive = proc.poll() is None
            print(
                f"  nopoll serve: {'still running, same PID' if alive else 'EXITED'} "
                f"(worker crashes: {0 if alive else 1}); "
                f"provider requests: {dict(provider.requests)}"
            )
            failed |= not alive
            tracebacks = log.read_text(errors="replace").count("Traceback")
            print(f"  tracebacks in its log: {tracebacks}")
        finally:
            stop_process(proc)
    print(load_note())
    print("RESULT: " + ("MISSED" if failed else "all targets met"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
