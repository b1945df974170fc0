"""The shared per-provider rate limit: nopoll's GCRA script next to the ``limits``
package's Redis limiters, under the same concurrency, in the same run.

    python bench/ratelimit.py                   # 50/s, 2 processes x 20 callers, 10 s each
    python bench/ratelimit.py --rate 200 --seconds 5

Each case runs ``--procs`` processes of ``--callers`` coroutines that each take a slot and
"send" (record the time) as fast as the limiter lets them, against Redis db 13:

- ``gcra``: ``receiver.providers.ratelimit.RateLimiter.acquire`` (one script call books the next
  slot and says how long to sleep);
- ``limits moving``, ``limits sliding``: ``limits.aio`` ``MovingWindowRateLimiter`` and
  ``SlidingWindowCounterRateLimiter`` on ``RedisStorage`` (redis-py): ``hit()`` answers
  yes or no, so a refused caller sleeps ``--retry-ms`` and asks again (what a poller would
  have to do).

Per case: grants per second, the busiest one-second window (over every process, sorted
grant times: must be <= the rate), the busiest 100 ms (how bursty), Redis commands per
grant (``INFO commandstats``) and the callers' CPU per grant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REDIS_URL, flush_bench_db, load_note, redis_db13


def _caller_proc(
    case: str,
    rate: float,
    seconds: float,
    callers: int,
    retry_ms: float,
    out: multiprocessing.Queue,
) -> None:
    async def main() -> list[float]:
        stamps: list[float] = []
        stop = time.time() + seconds
        if case == "gcra":
            from redis.asyncio import Redis

            from receiver.providers.ratelimit import RateLimiter

            redis = Redis.from_url(REDIS_URL)
            limiter = RateLimiter(redis, "bench", rate)

            async def one() -> None:
                for _ in range(100_000):
                    if time.time() >= stop:
                        return
                    await limiter.acquire(limit_s=seconds + 5)
                    stamps.append(time.time())

            await asyncio.gather(*(one() for _ in range(callers)))
            await redis.aclose()
            return stamps
        from limits import RateLimitItemPerSecond
        from limits.aio.storage import RedisStorage
        from limits.aio.strategies import (
            MovingWindowRateLimiter,
            SlidingWindowCounterRateLimiter,
        )

        storage = RedisStorage(REDIS_URL, implementation="redispy")
        strategy = (
            MovingWindowRateLimiter
            if case == "limits moving"
            else (SlidingWindowCounterRateLimiter)
        )
        limiter = strategy(storage)
        item = RateLimitItemPerSecond(int(rate))

        async def one_limits() -> None:
            for _ in range(1_000_000):
                if time.time() >= stop:
                    return
                if await limiter.hit(item, "bench"):
                    stamps.append(time.time())
                else:
                    await asyncio.sleep(retry_ms / 1000)

        await asyncio.gather(*(one_limits() for _ in range(callers)))
        return stamps

    started = resource.getrusage(resource.RUSAGE_SELF)
    stamps = asyncio.run(main())
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (used.ru_utime - started.ru_utime) + (used.ru_stime - started.ru_stime)
    out.put((stamps, cpu))


def _busiest(stamps: list[float], width: float) -> int:
    best, start = 0, 0
    for end, t in enumerate(stamps):
        while t - stamps[start] >= width:
            start += 1
        best = max(best, end - start + 1)
    return best


def _commands() -> int:
    r = redis_db13()
    try:
        stats = r.info("commandstats")
    finally:
        r.close()
    return sum(int(v["calls"]) for v in stats.values())


def run(case: str, args: argparse.Namespace) -> dict:
    flush_bench_db()
    r = redis_db13()
    r.config_resetstat()
    r.close()
    before = _commands()
    out: multiprocessing.Queue = multiprocessing.Queue()
    procs = [
        multiprocessing.Process(
            target=_caller_proc,
            args=(case, args.rate, args.seconds, args.callers, args.retry_ms, out),
        )
        for _ in range(args.procs)
    ]
    for p in procs:
        p.start()
    stamps: list[float] = []
    cpu = 0.0
    for _ in procs:
        s, c = out.get(timeout=args.seconds + 60)
        stamps += s
        cpu += c
    for p in procs:
        p.join(30)
    commands = _commands() - before - 2  # the two INFO calls themselves
    stamps.sort()
    return {
        "case": case,
        "grants": len(stamps),
        "per_s": len(stamps) / args.seconds,
        "busiest_1s": _busiest(stamps, 1.0),
        "busiest_100ms": _busiest(stamps, 0.1),
        "commands_per_grant": commands / max(len(stamps), 1),
        "cpu_us_per_grant": cpu / max(len(stamps), 1) * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--callers", type=int, default=20)
    parser.add_argument("--retry-ms", type=float, default=10.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [run(case, args) for case in ("gcra", "limits moving", "limits sliding")]
    print(
        f"\nrate {args.rate:g}/s, {args.procs} processes x {args.callers} callers, "
        f"{args.seconds:g} s each; a refused `limits` caller retries after {args.retry_ms:g} ms"
    )
    print(
        f"{'case':16} {'grants/s':>9} {'busiest 1 s':>12} {'busiest 100 ms':>15} "
        f"{'Redis cmds/grant':>17} {'CPU us/grant':>13}"
    )
    for row in rows:
        print(
            f"{row['case']:16} {row['per_s']:9.1f} {row['busiest_1s']:12} "
            f"{row['busiest_100ms']:15} {row['commands_per_grant']:17.1f} "
            f"{row['cpu_us_per_grant']:13.0f}"
        )
    print(
        f"(limit {args.rate:g} in any second; an even spread puts {args.rate / 10:g} in any 100 ms)"
    )
    print(load_note())
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["busiest_1s"] <= args.rate for r in rows[:1]) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
