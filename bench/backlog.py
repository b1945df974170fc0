"""Does a worker's CPU per result grow with its backlog?

Usage: ``python bench/backlog.py [--sizes 1000,10000,100000] [--log-level warning]``

For each size N: a fresh Redis db 13 and results table, the provider simulator (a real
HTTP server on 127.0.0.1, answering every ``GET /v1/responses/resp_...`` with a completed
response) and one ``nopoll worker`` with the Postgres sink (``bench_results``), started
and idle. N ``fetch_response`` jobs, as a callback queues them, are written beside the
queue and then moved onto it in one ``ZUNIONSTORE`` (and the queue's bell rung), so the
worker meets a backlog of N at once. It drains them; the benchmark takes the worker's CPU
time (``/proc``) from that moment until N rows are in Postgres.

Prints, per size: the drain's time, results/s, the worker's CPU per result, Redis's, and
each size's worker CPU per result as a ratio of the smallest size's (the target: the
largest within 1.2x). The load average and what else was busy is printed first.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common
import e2e

from nopoll.envelope import now_rfc3339
from receiver.queue._arq import JOB_KEY, WAKE_KEY, job_payload
from receiver.queue.jobs import FETCH_RESPONSE, FetchResponse, queue_for

TARGET_RATIO = 1.2
STAGING = "bench:backlog:staging"


def fill(n: int, nonce: str) -> list[str]:
    """N response jobs, as a callback queues them, beside the queue (not due to anyone)."""
    client = common.redis_db13()
    ids = [f"resp_backlog{nonce}_{i:07d}" for i in range(n)]
    now_ms, received_at = int(time.time() * 1000), now_rfc3339()
    try:
        for start in range(0, n, 2000):
            pipe = client.pipeline(transaction=False)
            for i, rid in enumerate(ids[start : start + 2000], start):
                job = FetchResponse(
                    provider=common.PROVIDER, received_at=received_at, response_id=rid
                )
                payload = job_payload(FETCH_RESPONSE, job.to_kwargs(), None, now_ms + i)
                pipe.set(JOB_KEY + job.job_id, payload, px=7 * 86400 * 1000)
                pipe.zadd(STAGING, {job.job_id: now_ms + i})
            pipe.execute()
    finally:
        client.close()
    return ids


def release() -> None:
    """The staged jobs onto the queue in one command, and the bell rung."""
    client = common.redis_db13()
    queue = queue_for(FETCH_RESPONSE)
    try:
        client.zunionstore(queue, [queue, STAGING])
        client.delete(STAGING)
        client.rpush(WAKE_KEY + queue, "1")
    finally:
        client.close()


async def landed_count(conn) -> int:  # type: ignore[no-untyped-def]
    value = await conn.fetchval(
        f"SELECT count(*) FROM {e2e.TABLE} WHERE provider = $1", common.PROVIDER
    )
    return int(value or 0)


async def wait_drained(n: int, limit_s: float) -> float:
    """Seconds until N rows are in the table (bounded by ``limit_s``)."""
    import asyncpg

    conn = await asyncpg.connect(common.PG_URL, timeout=10)
    start = time.monotonic()
    try:
        await e2e.wait_for_table(conn)
        while time.monotonic() - start < limit_s:
            if await landed_count(conn) >= n:
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        raise SystemExit(f"{await landed_count(conn)} of {n} rows after {limit_s:.0f} s")
    finally:
        await conn.close()


def run_size(n: int, log_level: str) -> dict[str, float]:
    asyncio.run(e2e.prepare_postgres())
    common.flush_bench_db()
    secret = common.new_secret()
    with tempfile.TemporaryDirectory(prefix="nopoll-backlog-") as tmp:
        work = Path(tmp)
        sim = worker = None
        try:
            sim, _, base_url = e2e.start_simulator(work)
            config = common.nopoll_config(
                work / "nopoll.yaml",
                base_url=base_url,
                data_dir=work / "data",
                sinks_yaml=f"  results: {{type: sql, url: '{common.PG_URL}', table: {e2e.TABLE}}}",
                log_level=log_level,
            )
            health = common.free_port()
            command = ["worker", "--config", str(config), "--health-port", str(health)]
            worker = common.start_process(
                [str(common.BIN_DIR / "nopoll"), *command],
                env={common.SECRET_ENV: secret},
                log_path=work / "worker.log",
            )
            common.wait_http(f"http://127.0.0.1:{health}/healthz", proc=worker, timeout_s=60)
            filled = time.monotonic()
            fill(n, uuid.uuid4().hex[:8])
            filled = time.monotonic() - filled
            time.sleep(1.0)  # the worker settles idle (its sink opened, its first beats)
            redis = e2e.redis_pid().get("redis (shared)")
            before = common.cpu_seconds(worker.pid), common.cpu_seconds(redis)
            release()
            seconds = asyncio.run(wait_drained(n, limit_s=60 + n / 200))
            worker_s = common.cpu_seconds(worker.pid) - before[0]
            redis_s = common.cpu_seconds(redis) - before[1]
        finally:
            common.stop_process(worker)
            common.stop_process(sim)
    figures = {
        "n": n,
        "fill_s": filled,
        "drain_s": seconds,
        "rate": n / seconds,
        "worker_ms": worker_s / n * 1000,
        "redis_ms": redis_s / n * 1000,
    }
    print(
        f"backlog {n:>7}: drained in {seconds:6.1f} s ({n / seconds:6.0f} results/s; queued in "
        f"{filled:.1f} s); worker CPU per result {figures['worker_ms']:.3f} ms, Redis "
        f"{figures['redis_ms']:.3f} ms",
        flush=True,
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="backlogs (1000,10000,100000)")
    parser.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error")
    )
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if not sizes or sizes[0] < 100 or sizes[-1] > 500_000:
        parser.error("--sizes: each from 100 to 500000")
    print(f"one worker drains a backlog of {args.sizes}; {common.load_note()}", flush=True)
    results = [run_size(n, args.log_level) for n in sizes]
    base = results[0]["worker_ms"]
    print()
    for r in results:
        print(
            f"backlog {int(r['n']):>7}: worker CPU per result {r['worker_ms']:.3f} ms = "
            f"{r['worker_ms'] / base:.2f}x the {sizes[0]:,} backlog's"
        )
    ratio = results[-1]["worker_ms"] / base
    verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
    print(
        f"target: CPU per result at {sizes[-1]:,} queued within {TARGET_RATIO}x of "
        f"{sizes[0]:,}: {ratio:.2f}x ({verdict}); {common.load_note()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
