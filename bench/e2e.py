"""End-to-end latency: a signed callback in, a row in Postgres out.

Usage: ``python bench/e2e.py [--rate 200] [--seconds 20]``

Starts the provider simulator (``receiver.simulator.ProviderSimulator``, a real HTTP
server on 127.0.0.1 in a thread) and ``nopoll serve`` (API + worker in one process) with
Redis database 13 and one sink, ``{type: sql, url: postgresql://...test, table:
bench_results}``; waits for ``/readyz``; then sends ``response.completed`` callbacks at a
steady rate with ``receiver.simulator.send_callback`` (signed by ``standardwebhooks``),
one new response id each, recording when each was sent. A poller asks Postgres every
few milliseconds which of the outstanding keys have a row and records when each shows
up. Prints p50/p90/p99 of callback-to-row latency, rows landed / sent, and provider
requests per delivered result (the simulator's count of ``GET /v1/responses/...``).

Exits 1 when a row is missing or a callback was not answered 202. The latency includes
the poller's own granularity (``--poll-ms``, default 5 ms, plus the query's time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    BIN_DIR,
    PG_URL,
    PROVIDER,
    SECRET_ENV,
    flush_bench_db,
    free_port,
    new_secret,
    nopoll_config,
    percentile,
    start_process,
    stop_process,
    wait_http,
)

TABLE = "bench_results"
TARGET_P99_MS = 250.0
TARGET_P50_MS = 50.0
TARGET_REQUESTS_PER_RESULT = 1.0


@dataclass
class Run:
    """What happened to every callback, keyed by response id."""

    sent_at: dict[str, float] = field(default_factory=dict)
    acked_at: dict[str, float] = field(default_factory=dict)
    status: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    landed_at: dict[str, float] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)
    sending_done: bool = False
    send_started: float = 0.0
    send_finished: float = 0.0
    polls: int = 0
    table_rows: int = -1


async def prepare_postgres() -> None:
    """Drop the benchmark's table (and its schema-version row) before the run."""
    import asyncpg

    conn = await asyncpg.connect(PG_URL, timeout=10)
    try:
        await conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        if await conn.fetchval("SELECT to_regclass('nopoll_schema') IS NOT NULL"):
            await conn.execute("DELETE FROM nopoll_schema WHERE table_name = $1", TABLE)
    finally:
        await conn.close()


async def wait_for_table(conn: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.1) + 1):
        if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", TABLE):  # type: ignore[attr-defined]
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the sql sink did not create table {TABLE} within {timeout_s:.0f}s")


async def send_all(run: Run, url: str, secret: str, ids: list[str], rate: float) -> None:
    """Send one callback per id at a steady ``rate``, each in its own task."""
    import httpx

    from receiver.simulator import send_callback

    async def one(client: httpx.AsyncClient, rid: str) -> None:
        run.pending.add(rid)
        run.sent_at[rid] = time.perf_counter()
        try:
            resp = await send_callback(client, url, secret, rid)
        except httpx.HTTPError as exc:
            run.errors[rid] = type(exc).__name__
            return
        run.acked_at[rid] = time.perf_counter()
        run.status[rid] = resp.status_code

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=10.0, limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []
        run.send_started = start = time.perf_counter()
        for i, rid in enumerate(ids):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, rid)))
        run.send_finished = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    run.sending_done = True


async def poll_rows(run: Run, conn: object, poll_s: float, drain_s: float, max_s: float) -> None:
    """Record when each outstanding key's row becomes visible; bounded in time and count."""
    query = f"SELECT key FROM {TABLE} WHERE provider = $1 AND key = ANY($2::text[])"
    started = time.perf_counter()
    drain_deadline: float | None = None
    for _ in range(int(max_s / poll_s) + 1):
        now = time.perf_counter()
        if now - started > max_s:
            break
        if run.sending_done:
            if not run.pending:
                break
            if drain_deadline is None:
                drain_deadline = now + drain_s
            elif now > drain_deadline:
                break
        if run.pending:
            keys = list(run.pending)
            rows = await conn.fetch(query, PROVIDER, keys)  # type: ignore[attr-defined]
            seen = time.perf_counter()
            run.polls += 1
            for row in rows:
                key = row["key"]
                if key in run.pending:
                    run.pending.discard(key)
                    run.landed_at[key] = seen
        await asyncio.sleep(poll_s)


async def measure(args: argparse.Namespace, url: str, secret: str, ids: list[str]) -> Run:
    import asyncpg

    run = Run()
    conn = await asyncpg.connect(PG_URL, timeout=10)
    try:
        await wait_for_table(conn)
        max_s = args.seconds + args.drain + 90
        poller = asyncio.create_task(
            poll_rows(run, conn, args.poll_ms / 1000, args.drain, max_s), name="poller"
        )
        try:
            await send_all(run, url, secret, ids, args.rate)
            await asyncio.wait_for(poller, timeout=max_s)
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        run.table_rows = int(
            await conn.fetchval(f"SELECT count(*) FROM {TABLE} WHERE provider = $1", PROVIDER)  # type: ignore[attr-defined]
        )
    finally:
        await conn.close()
    return run


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="callbacks per second (200)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of sending (20)")
    parser.add_argument(
        "--drain", type=float, default=30.0, help="seconds to wait for late rows (30)"
    )
    parser.add_argument("--poll-ms", type=float, default=5.0, help="Postgres poll interval (5)")
    args = parser.parse_args(argv)
    if not (0 < args.rate <= 5000 and 0 < args.seconds <= 600 and 0 <= args.drain <= 600):
        parser.error("--rate 0..5000, --seconds 0..600, --drain 0..600")
    if not 1 <= args.poll_ms <= 1000:
        parser.error("--poll-ms 1..1000")

    from receiver.simulator import ProviderSimulator

    total = max(1, math.floor(args.rate * args.seconds))
    nonce = uuid.uuid4().hex[:10]
    ids = [f"resp_e2e{nonce}_{i:06d}" for i in range(total)]
    secret = new_secret()
    api_key = "bench-key"

    asyncio.run(prepare_postgres())
    flush_bench_db()
    sim = ProviderSimulator(api_key=api_key)
    proc = None
    with tempfile.TemporaryDirectory(prefix="nopoll-e2e-") as tmp:
        work = Path(tmp)
        log_path = work / "nopoll.log"
        try:
            sim.start()
            for rid in ids:
                sim.add_response(rid)
            config = nopoll_config(
                work / "nopoll.yaml",
                base_url=sim.base_url,
                data_dir=work / "data",
                sinks_yaml=f"  results: {{type: sql, url: '{PG_URL}', table: {TABLE}}}",
            )
            port = free_port()
            proc = start_process(
                [
                    str(BIN_DIR / "nopoll"),
                    "serve",
                    "--config",
                    str(config),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                env={SECRET_ENV: secret},
                log_path=log_path,
            )
            wait_http(
                f"http://127.0.0.1:{port}/readyz", proc=proc, timeout_s=60, log_path=log_path
            )
            print(
                f"nopoll serve on 127.0.0.1:{port}, simulator on {sim.base_url}; sending "
                f"{total} callbacks at {args.rate:g}/s for {args.seconds:g}s"
            )
            url = f"http://127.0.0.1:{port}/webhooks/{PROVIDER}"
            run = asyncio.run(measure(args, url, secret, ids))
            provider_requests = sim.request_count("/v1/responses/")
        finally:
            stop_process(proc)
            sim.stop()
        if proc is not None and proc.returncode not in (0, None):
            print(f"note: nopoll serve exited with {proc.returncode}")
            print(log_path.read_text(errors="replace")[-3000:])

    return report(args, run, ids, provider_requests)


def report(args: argparse.Namespace, run: Run, ids: list[str], provider_requests: int) -> int:
    total = len(ids)
    latencies = sorted(
        (run.landed_at[rid] - run.sent_at[rid]) * 1000 for rid in ids if rid in run.landed_at
    )
    acks = sorted(
        (run.acked_at[rid] - run.sent_at[rid]) * 1000 for rid in ids if rid in run.acked_at
    )
    landed = len(latencies)
    not_202 = {rid: s for rid, s in run.status.items() if s != 202}
    send_s = run.send_finished - run.send_started
    per_result = provider_requests / landed if landed else float("nan")
    p50, p90, p99 = (percentile(latencies, q) for q in (50, 90, 99))

    print()
    print(f"sent:            {total} callbacks in {send_s:.2f}s ({total / send_s:.1f}/s)")
    print(
        f"answers:         {len(run.status)} ({len(run.status) - len(not_202)} x 202), "
        f"{len(run.errors)} transport errors; 202 in p50 {percentile(acks, 50):.1f} ms, "
        f"p99 {percentile(acks, 99):.1f} ms"
    )
    print(
        f"rows landed:     {landed} / {total} ({landed / total:.4f}); "
        f"table holds {run.table_rows} rows; {run.polls} polls"
    )
    if latencies:
        print(
            f"callback -> row: p50 {p50:.1f} ms  p90 {p90:.1f} ms  p99 {p99:.1f} ms  "
            f"max {latencies[-1]:.1f} ms"
        )
    print(
        f"provider requests per result: {per_result:.3f} "
        f"({provider_requests} GET /v1/responses/ for {landed} rows)"
    )
    print()
    print(f"target: p99 < {TARGET_P99_MS:g} ms: {p99:.1f} ms ({verdict(p99 < TARGET_P99_MS)})")
    print(f"target: p50 < {TARGET_P50_MS:g} ms: {p50:.1f} ms ({verdict(p50 < TARGET_P50_MS)})")
    print(
        f"target: requests per result {TARGET_REQUESTS_PER_RESULT:.1f}: {per_result:.3f} "
        f"({verdict(abs(per_result - TARGET_REQUESTS_PER_RESULT) < 1e-9)})"
    )
    failed = False
    if landed < total:
        missing = [rid for rid in ids if rid not in run.landed_at]
        print(f"MISSING ROWS: {len(missing)}, e.g. {', '.join(missing[:5])}")
        failed = True
    if not_202 or run.errors:
        sample = list(not_202.items())[:5] + list(run.errors.items())[:5]
        print(f"CALLBACKS NOT ANSWERED 202: {len(not_202) + len(run.errors)}, e.g. {sample}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
