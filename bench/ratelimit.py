"""The shared per-provider rate limit: nopoll's GCRA script next to the ``limits``
package's Redis limiters, under the same concurrency, in the same run; then a provider
account's request budget as the provider sees it.

    python bench/ratelimit.py                   # 50/s, 2 processes x 20 callers, 10 s each
    python bench/ratelimit.py --rate 200 --seconds 5
    python bench/ratelimit.py --only budget --rate 5 --seconds 20

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

- ``budget``: ``--procs`` processes of ``--callers`` coroutines send real requests through
  ``receiver.providers.ProviderClient`` with one account's budget
  (``receiver.providers.budget``, ``rate_limit_rps`` = ``--rate``) to the provider simulator,
  as fast as it lets them, taking turns at the three kinds a Valar account sees: a
  response's GET (a poll), a batch row's GET, a create (``POST /responses``). Counted at the
  simulator: requests/s it saw over the run, that figure's ratio to the budget (slots are
  1.1 / rate apart, so about 0.91), and its busiest second (must be <= the rate).
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


def _budget_proc(
    base_url: str, rate: float, seconds: float, callers: int, out: multiprocessing.Queue
) -> None:
    """One process of the ``budget`` case: ``callers`` coroutines, each sending requests of
    the three kinds in turn through one account's budget until ``seconds`` are up."""

    async def main() -> int:
        from redis.asyncio import Redis

        from nopoll.exceptions import TransientProviderError
        from receiver.config.accounts import DEFAULT_TENANT
        from receiver.config.settings import HttpConfig, ProviderConfig
        from receiver.providers import ProviderClient
        from receiver.providers.budget import account_budget

        redis = Redis.from_url(REDIS_URL)
        config = ProviderConfig(
            dialect="valar", base_url=base_url, api_key="sk-bench", rate_limit_rps=rate
        )
        budget = account_budget(redis, "bench", DEFAULT_TENANT, config)
        client = ProviderClient("bench", config, HttpConfig(), budget=budget)
        stop = time.time() + seconds
        sent = 0

        async def one(caller: int) -> None:
            nonlocal sent
            for n in range(1_000_000):
                if time.time() >= stop:
                    return
                kind = (caller + n) % 3
                try:
                    if kind == 0:
                        await client.get_json(f"responses/resp_bench_{n % 100}", wait_s=seconds)
                    elif kind == 1:
                        await client.get_json(
                            f"batches/bench_rows/row-{n % 100:06d}", wait_s=seconds
                        )
                    else:
                        body = b'{"model":"m-1","input":"hi","background":true}'
                        await client.post_once(
                            "responses",
                            body,
                            content_type="application/json",
                            idempotency_key=f"bench-{os.getpid()}-{caller}-{n}",
                            wait_s=seconds,
                        )
                except TransientProviderError:  # no slot within the run (NoRequestSlot)
                    return
                sent += 1

        await asyncio.gather(*(one(i) for i in range(callers)))
        await client.aclose()
        await redis.aclose()
        return sent

    out.put(asyncio.run(main()))


def run_budget(args: argparse.Namespace) -> dict:
    """The ``budget`` case (see the module docs)."""
    from receiver.demo.simulator import ProviderSimulator

    flush_bench_db()
    with ProviderSimulator(api_key="sk-bench") as sim:
        for i in range(100):
            sim.add_response(f"resp_bench_{i}")
        sim.add_batch("valar", "bench_rows", 100)
        out: multiprocessing.Queue = multiprocessing.Queue()
        procs = [
            multiprocessing.Process(
                target=_budget_proc,
                args=(sim.base_url, args.rate, args.seconds, args.callers, out),
            )
            for _ in range(args.procs)
        ]
        started = time.time()
        for p in procs:
            p.start()
        sent = sum(out.get(timeout=args.seconds + 60) for _ in procs)
        for p in procs:
            p.join(30)
        stamps = sorted(t for t in sim.request_times("/v1/") if t >= started)
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else args.seconds
    per_s = (len(stamps) - 1) / span if span > 0 else 0.0
    return {
        "case": "budget",
        "requests": len(stamps),
        "sent": sent,
        "per_s": per_s,
        "ratio": per_s / args.rate,
        "busiest_1s": _busiest(stamps, 1.0),
        "busiest_100ms": _busiest(stamps, 0.1),
    }


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
    parser.add_argument(
        "--only", choices=["limiters", "budget"], help="run only the limiters, or the budget"
    )
    args = parser.parse_args()
    if args.only == "budget":
        return _print_budget(run_budget(args), args)
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
    limiters_ok = all(r["busiest_1s"] <= args.rate for r in rows[:1])
    if args.only == "limiters":
        return 0 if limiters_ok else 1
    return max(0 if limiters_ok else 1, _print_budget(run_budget(args), args))


def _print_budget(row: dict, args: argparse.Namespace) -> int:
    print(
        f"\naccount budget {args.rate:g}/s (rate_limit_rps), {args.procs} processes x "
        f"{args.callers} callers, {args.seconds:g} s; polls, row GETs and creates in turn, "
        "counted at the provider simulator"
    )
    print(
        f"{'case':16} {'requests':>9} {'seen/s':>8} {'seen / budget':>14} "
        f"{'busiest 1 s':>12} {'busiest 100 ms':>15}"
    )
    print(
        f"{row['case']:16} {row['requests']:9} {row['per_s']:8.2f} {row['ratio']:14.3f} "
        f"{row['busiest_1s']:12} {row['busiest_100ms']:15}"
    )
    print(
        f"(slots are 1.1 / rate apart: {1 / 1.1:.3f} of the budget at most; never more than "
        f"{args.rate:g} in any second)"
    )
    print(load_note())
    return 0 if row["busiest_1s"] <= args.rate else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
