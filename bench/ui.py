"""The status page under a full store: render time of every page, and what live refresh costs.

    python bench/ui.py                  # 10,000 dead letters, 10,000 watches, 50 batches
    python bench/ui.py --letters 2000 --watches 2000 --open-pages 5 --seconds 10

1. Fills Redis database 13 through nopoll's own stores (``DeadLetters``, ``WatchStore``,
   ``BatchState``), starts ``nopoll api`` (its own process, no worker: nothing drains the
   store), logs in like a browser and times every page and every live fragment
   (``?part=1``) with ``--requests`` sequential GETs each, next to ``GET /healthz`` as the
   in-run baseline. The time is the client's (connect to last byte on 127.0.0.1): an upper
   bound of the server's. Target: p95 < 150 ms for every page.
2. ``--open-pages`` pages left open: each one fetches its fragment at htmx's interval
   (overview every 5 s, batches every 2 s, watches every 5 s, round robin), for
   ``--seconds``; the API process's CPU time over that, minus the same span idle, per
   page. Target: < 1 % of one core per open page.

Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    BIN_DIR,
    PROVIDER,
    REDIS_URL,
    SECRET_ENV,
    cpu_seconds,
    flush_bench_db,
    free_port,
    load_note,
    new_secret,
    nopoll_config,
    percentile,
    start_process,
    stop_process,
    wait_http,
)

ADMIN = "bench-admin-token-0123456789abcdef"
CSRF = re.compile(r'name="csrf" value="([^"]+)"')
PAGES = [
    ("/ui/", 5.0),
    ("/ui/batches", 2.0),
    ("/ui/watches", 5.0),
    ("/ui/deadletters", None),
]


async def fill(letters: int, watches: int, batches: int) -> None:
    from redis.asyncio import Redis

    from receiver.batches.progress import BatchState
    from receiver.queue.deadletter import DeadLetters
    from receiver.watches.store import WatchStore

    redis = Redis.from_url(REDIS_URL)
    try:
        store = DeadLetters(redis)
        for start in range(0, letters, 500):
            await asyncio.gather(
                *(
                    store.add(
                        sink="files" if i % 2 else "fetch",
                        provider=PROVIDER,
                        keys=[f"resp_{i:06d}"],
                        attempts=12,
                        error="SinkError: the sink refused the row: a NUL character",
                        function="deliver",
                        kwargs={"sink": "files", "envelopes": []},
                    )
                    for i in range(start, min(start + 500, letters))
                )
            )
        ws = WatchStore(redis)
        ids = [f"resp_w{i:06d}" for i in range(watches)]
        for start in range(0, watches, 1000):
            await ws.register_all(
                PROVIDER, "response", ids[start : start + 1000], first_poll_in_s=3600
            )
        for b in range(batches):
            state = BatchState.of(
                redis, PROVIDER, f"batch_{b:04d}", ttl_s=3600, job_expiry_ms=3_600_000
            )
            await state.begin(1000)
            await state.record_rows(100_000)
            for n in range(100 if b % 2 else 40):
                await state.record_counts(n, Counter({"completed": 990, "failed": 10}))
            await redis.hset(state.key, "c:files", str(99 if b % 2 else 39))
            if b % 2:
                await state.finish()
    finally:
        await redis.aclose()


def log_in(client: httpx.Client) -> None:
    page = client.get("/ui/login")
    token = CSRF.search(page.text)
    assert token, "no CSRF token on the login page"
    r = client.post("/ui/login", data={"token": ADMIN, "csrf": token.group(1)})
    assert r.status_code == 303, r.text


def timed(client: httpx.Client, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        r = client.get(path)
        out.append((time.perf_counter() - started) * 1000)
        assert r.status_code == 200, (path, r.status_code)
    return sorted(out)


async def open_pages(base: str, cookies: httpx.Cookies, pages: int, seconds: float) -> int:
    live = [(p, i) for p, i in PAGES if i is not None]
    done = 0

    async def page(k: int) -> None:
        nonlocal done
        path, interval = live[k % len(live)]
        stop = time.monotonic() + seconds
        async with httpx.AsyncClient(base_url=base, cookies=cookies) as client:
            await asyncio.sleep(interval * k / pages)  # spread, as pages opened at random
            for _ in range(int(seconds / interval) + 1):
                if time.monotonic() >= stop:
                    return
                r = await client.get(path, params={"part": "1"}, headers={"hx-request": "true"})
                assert r.status_code == 200
                done += 1
                await asyncio.sleep(interval)

    await asyncio.gather(*(page(k) for k in range(pages)))
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--letters", type=int, default=10_000)
    parser.add_argument("--watches", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--open-pages", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()

    flush_bench_db()
    print(
        f"filling Redis db 13: {args.letters:,} dead letters, {args.watches:,} watches, "
        f"{args.batches} batches ...",
        flush=True,
    )
    started = time.monotonic()
    asyncio.run(fill(args.letters, args.watches, args.batches))
    print(f"  filled in {time.monotonic() - started:.1f} s")

    tmp = Path(tempfile.mkdtemp(prefix="nopoll-bench-ui-"))
    config = nopoll_config(
        tmp / "nopoll.yaml",
        base_url="http://127.0.0.1:9/v1",
        data_dir=tmp / "data",
        sinks_yaml=f"  files: {{type: jsonl, dir: {tmp / 'out'}}}\n",
    )
    config.write_text(config.read_text() + f"admin_tokens: ['{ADMIN}']\n")
    port = free_port()
    log = tmp / "api.log"
    proc = start_process(
        [str(BIN_DIR / "nopoll"), "api", "--config", str(config), "--port", str(port)],
        env={SECRET_ENV: new_secret()},
        log_path=log,
    )
    failed = False
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/readyz", proc=proc, log_path=log)
        with httpx.Client(base_url=base, timeout=30) as client:
            log_in(client)
            for path, _ in PAGES:  # warm up: templates compiled, connections made
                client.get(path)
            rows = [("GET /healthz (baseline)", timed(client, "/healthz", args.requests))]
            paths = [p for p, _ in PAGES]
            paths += [f"{p}?part=1" for p, i in PAGES if i is not None]
            last_page = (args.letters + 49) // 50
            paths += [f"/ui/deadletters?page={last_page}", "/ui/deadletters?sink=files"]
            rows += [(f"GET {p}", timed(client, p, args.requests)) for p in paths]
            cookies = client.cookies
        print(f"\n{'page':52} {'p50 ms':>8} {'p95 ms':>8} {'x healthz':>10}")
        base_ms = statistics.median(rows[0][1])
        for name, ms in rows:
            p50, p95 = statistics.median(ms), percentile(ms, 95)
            print(f"{name:52} {p50:8.1f} {p95:8.1f} {p50 / base_ms:10.1f}")
            if name.startswith("GET /ui") and p95 >= 150:
                failed = True
        print("target: p95 < 150 ms for every page" + ("  MISSED" if failed else "  met"))

        print(
            f"\nidle {args.seconds:g} s, then {args.open_pages} open pages "
            f"for {args.seconds:g} s ...",
            flush=True,
        )
        before = cpu_seconds(proc.pid)
        time.sleep(args.seconds)
        idle = cpu_seconds(proc.pid) - before
        before = cpu_seconds(proc.pid)
        fetched = asyncio.run(open_pages(base, cookies, args.open_pages, args.seconds))
        busy = cpu_seconds(proc.pid) - before
        per_page = max(busy - idle, 0.0) / args.seconds / args.open_pages * 100
        print(
            f"API CPU: {idle / args.seconds * 100:.2f} % of a core idle, "
            f"{busy / args.seconds * 100:.2f} % with the pages open ({fetched} fragments)"
        )
        print(
            f"live refresh: {per_page:.3f} % of a core per open page (target < 1 %)"
            + ("  MISSED" if per_page >= 1 else "  met")
        )
        failed |= per_page >= 1
        print(load_note())
    finally:
        stop_process(proc)
        flush_bench_db()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
