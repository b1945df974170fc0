"""Watches: how many provider requests nopoll's polling makes, next to the documented loop.

Usage: ``python bench/watch.py [--n 10000] [--live-n 1000] [--live-scale 20]
[--idle-n 10000] [--idle-seconds 20] [--skip-live] [--skip-idle]``

The providers document one ``GET /responses/{id}`` per id per second until it finishes.
Completion times here are log-normal with median 60 s and p99 20 min (spread like real
background work). Three parts, each with its own baseline from the same run:

1. **Schedule** (simulated clock, ``--n`` ids registered over ``--submit-s``): the real
   ``receiver.worker.poller.next_interval_s`` with the default watch settings, every poll given
   a slot of the shared rate limit (``--rps``) in due order, as ``receiver.providers.ratelimit``
   does. Prints nopoll's requests / the 1-s loop's requests, the delay from completion to
   the poll that finds it, and the most polls in any one-second window.
2. **Live** (real clock, compressed ``--live-scale`` times): ``--live-n`` ids in the
   provider simulator (a real HTTP server on 127.0.0.1, in its own process) that stay
   ``in_progress`` until their completion time, registered at once and polled by two
   ``nopoll worker`` processes into Postgres (table ``bench_watch``). Every setting is
   scaled alike (first poll 1/scale s, cap 60/scale s, rate limit ``--rps`` x scale x
   live-n / n, so the provider is as busy as in part 1). Counts GETs and their arrival
   times at the simulator and when each row shows up in Postgres.
3. **Idle** (real clock): one ``nopoll worker`` with no watches, then the same worker
   with ``--idle-n`` watches that are not due (first poll in an hour): its CPU and
   Redis's, as a share of one core; the watches' cost is the difference.

Exits 1 when a target is missed or a completed id never got its row.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import math
import random
import subprocess
import sys
import tempfile
import time
from bisect import bisect_left
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common

from receiver.config.settings import WatchConfig
from receiver.providers.ratelimit import JITTER_ALLOWANCE_S
from receiver.worker.poller import next_interval_s

MEDIAN_S = 60.0
P99_S = 1200.0
SIGMA = math.log(P99_S / MEDIAN_S) / 2.3263  # z of the 99th percentile
TARGET_RATIO = 0.05
TARGET_EXTRA_S = 2.0
TARGET_IDLE_CORE = 0.02
TABLE = "bench_watch"
API_KEY = "bench-key"


def completion_times(n: int, seed: int) -> list[float]:
    rnd = random.Random(seed)
    return [MEDIAN_S * math.exp(rnd.gauss(0.0, SIGMA)) for _ in range(n)]


def loop_requests(done_s: list[float], period_s: float = 1.0) -> int:
    """GETs the documented loop makes: one at once, then one a period until done."""
    return sum(math.floor(t / period_s) + 1 for t in done_s)


def busiest_window(times: list[float], width_s: float = 1.0) -> int:
    """The most arrivals in any window ``[t, t + width_s)``, over every start ``t``."""
    times = sorted(times)
    edge = width_s - 1e-9  # slots k/rps apart: no float error may count one twice
    return max((bisect_left(times, t + edge) - i for i, t in enumerate(times)), default=0)


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# --- part 1: the schedule on a simulated clock -------------------------------------------


def schedule(n: int, rps: float, submit_s: float, seed: int) -> dict[str, float]:
    random.seed(seed)  # next_interval_s draws its jitter from the random module
    cfg = WatchConfig(rate_limit_rps=rps) if math.isfinite(rps) else WatchConfig()
    done = completion_times(n, seed)
    registered = [submit_s * i / n for i in range(n)]
    due = [(registered[i] + cfg.first_poll_s, i, 1) for i in range(n)]
    heapq.heapify(due)
    gap = (1 + JITTER_ALLOWANCE_S) / rps  # the slots receiver.providers.ratelimit hands out
    next_slot, polls, delays, at_times = 0, 0, [], []
    for _ in range(200 * n):  # bounded: every id ends long before this
        if not due:
            break
        when, i, k = heapq.heappop(due)
        slot = max(next_slot, math.ceil(when / gap - 1e-9)) if math.isfinite(rps) else 0
        at = slot * gap if math.isfinite(rps) else when
        next_slot = slot + 1
        polls += 1
        at_times.append(at)
        if at - registered[i] >= done[i]:
            delays.append(at - registered[i] - done[i])
        else:
            heapq.heappush(due, (at + next_interval_s(cfg, k), i, k + 1))
    delays.sort()
    return {
        "ratio": polls / loop_requests(done),
        "polls_per_id": polls / n,
        "p50": common.percentile(delays, 50),
        "p99": common.percentile(delays, 99),
        "busiest": busiest_window(at_times) if math.isfinite(rps) else float("nan"),
        "ended": len(delays),
    }


def part_schedule(args: argparse.Namespace) -> bool:
    print(f"== 1. schedule: {args.n} ids, simulated clock, registered over {args.submit_s:g} s")
    done = completion_times(args.n, args.seed)
    loop = loop_requests(done)
    print(f"documented 1-s loop: {loop} GETs ({loop / args.n:.1f} per id)")
    print("rate limit | nopoll GETs / loop GETs | GETs per id | delay p50 / p99 | busiest 1 s")
    checked: dict[str, float] = {}
    for rps in [*sorted({100.0, 200.0, args.rps, 500.0}), math.inf]:
        r = schedule(args.n, rps, args.submit_s, args.seed)
        checked = r if rps == args.rps else checked
        mark = " <- checked" if rps == args.rps else ""
        busiest = "-" if math.isnan(r["busiest"]) else f"{r['busiest']:.0f}"
        print(
            f"{rps:>10g} | {r['ratio']:.4f} | {r['polls_per_id']:.2f} | "
            f"{r['p50']:.1f} s / {r['p99']:.1f} s | {busiest}{mark}"
        )
    import receiver.worker.poller as poller

    growth, poller.GROWTH = poller.GROWTH, 2.0  # the baseline schedule: doubling
    try:
        doubling = schedule(args.n, math.inf, args.submit_s, args.seed)
    finally:
        poller.GROWTH = growth
    print(
        f"{'inf':>10} | {doubling['ratio']:.4f} | {doubling['polls_per_id']:.2f} | "
        f"{doubling['p50']:.1f} s / {doubling['p99']:.1f} s | - <- intervals doubling, not x4"
    )
    cap = WatchConfig().max_interval_s
    ok = (
        checked["ratio"] <= TARGET_RATIO
        and checked["p99"] <= cap + TARGET_EXTRA_S
        and checked["busiest"] <= args.rps
        and checked["ended"] == args.n
    )
    print(
        f"target: ratio <= {TARGET_RATIO}: {checked['ratio']:.4f}; p99 delay <= "
        f"{cap + TARGET_EXTRA_S:g} s: {checked['p99']:.1f} s; busiest second <= {args.rps:g}: "
        f"{checked['busiest']:.0f} ({verdict(ok)})"
    )
    return ok


# --- part 2: live, on a compressed clock -------------------------------------------------


def live_config(path: Path, base_url: str, watch: dict[str, float], data_dir: Path) -> Path:
    fields = ", ".join(f"{k}: {v:g}" for k, v in watch.items())
    path.write_text(
        f"""\
redis_url: {common.REDIS_URL}
data_dir: {data_dir}
log_level: warning
providers:
  sim:
    dialect: openai
    base_url: {base_url}
    api_key: {API_KEY}
    webhook_secrets: []
    watch: {{{fields}}}
sinks:
  warehouse: {{type: sql, url: "{common.PG_URL}", table: {TABLE}}}
""",
        encoding="utf-8",
    )
    return path


async def watch_rows(ids: set[str], deadline: float) -> dict[str, float]:
    """When each id's row first shows up (asked every 0.1 s until all or the deadline)."""
    import asyncpg

    seen: dict[str, float] = {}
    conn = None
    for _ in range(int((deadline - time.time()) / 0.1) + 2):
        if len(seen) == len(ids) or time.time() > deadline:
            break
        try:
            conn = conn or await asyncpg.connect(common.PG_URL)
            rows = await conn.fetch(f"SELECT key FROM {TABLE}")
        except Exception:  # the table is made by the first write
            rows = []
        now = time.time()
        for row in rows:
            seen.setdefault(row["key"], now)
        await asyncio.sleep(0.1)
    if conn is not None:
        await conn.close()
    return seen


def serve_simulator(port: int, spec: Path, out: Path) -> int:
    """``--simulator PORT SPEC OUT``: the provider simulator in a process of its own (so
    its arrival times are not skewed by this process's work), serving the responses of
    ``SPEC`` (JSON ``{id: unix time it completes}``) until SIGTERM, then writing every
    ``GET /v1/responses/...`` as ``[time, id]`` to ``OUT``."""
    import json
    import signal
    import threading

    from receiver.demo.simulator import ProviderSimulator

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ProviderSimulator(api_key=API_KEY, port=port) as sim:
        for rid, at in json.loads(spec.read_text()).items():
            sim.add_response(rid, pending_until=at, text="done")
        for _ in range(4 * 3600 * 2):  # bounded: at most four hours
            if stop.wait(0.5):
                break
        with sim.state.lock:
            gets = [(t, p.rsplit("/", 1)[1]) for t, p in sim.state.times]
    out.write_text(json.dumps(gets))
    return 0


async def register(ids: list[str], watch: dict[str, float]) -> None:
    """Register ``ids`` as ``nopoll watch`` does (it is tested on its own; here the
    registration must take milliseconds, not an interpreter's start-up)."""
    from redis.asyncio import Redis

    from receiver.watches.store import WatchStore, register_many

    redis = Redis.from_url(common.REDIS_URL)
    try:
        store = WatchStore(redis)
        done = await register_many(
            store,
            "sim",
            "response",
            ids,
            first_poll_s=watch["first_poll_s"],
            reconcile_after_s=0,
            expect_callback=False,
        )
        assert done.watching == len(ids), done
    finally:
        await redis.aclose()


def part_live(args: argparse.Namespace, work: Path) -> bool:
    import json

    k, n = args.live_scale, args.live_n
    rps = args.rps * k * n / args.n
    watch = {"first_poll_s": 1 / k, "max_interval_s": 60 / k, "rate_limit_rps": rps}
    print(f"\n== 2. live: {n} ids, clock x{k:g}, two workers, rate limit {rps:g}/s")
    common.flush_bench_db()
    asyncio.run(common.drop_table(TABLE))
    done = [t / k for t in completion_times(n, args.seed + 1)]
    ids = [f"resp_watch{i:06d}" for i in range(n)]
    start = time.time() + 12.0  # the simulator and workers are up by then (checked)
    spec, out = work / "spec.json", work / "gets.json"
    spec.write_text(json.dumps({rid: start + t for rid, t in zip(ids, done, strict=True)}))
    port = common.free_port()
    sim_cmd = [sys.executable, __file__, "--simulator", str(port), str(spec), str(out)]
    sim = common.start_process(sim_cmd, log_path=work / "sim.log")
    base_url = f"http://127.0.0.1:{port}/v1"
    workers: list[subprocess.Popen[bytes]] = []
    try:
        common.wait_http(f"{base_url}/responses/probe", proc=sim, want=401)
        config = live_config(work / "live.yaml", base_url, watch, work / "data")
        for i in range(2):
            health = common.free_port()
            cmd = [str(common.BIN_DIR / "nopoll"), "worker", "--config", str(config)]
            cmd += ["--health-port", str(health)]
            log_path = work / f"worker{i}.log"
            workers.append(common.start_process(cmd, log_path=log_path))
            common.wait_http(f"http://127.0.0.1:{health}/healthz", proc=workers[-1])
        if time.time() > start:
            raise RuntimeError("the workers took over 12 s to start: the run would be skewed")
        time.sleep(max(0.0, start - time.time()))
        asyncio.run(register(ids, watch))  # in a few ms: completion times count from here
        cutoff = start + args.live_seconds
        seen = asyncio.run(watch_rows(set(ids), cutoff + 60 / k + 5))
    finally:
        for proc in workers:
            common.stop_process(proc)
        common.stop_process(sim)
    gets_by_id = json.loads(out.read_text()) if out.exists() else []
    gets = [t for t, _ in gets_by_id]
    last_get = {rid: t for t, rid in gets_by_id}
    due = [(rid, start + t) for rid, t in zip(ids, done, strict=True) if start + t < cutoff]
    missing = [rid for rid, _ in due if rid not in seen]
    delays = sorted(seen[rid] - at for rid, at in due if rid in seen)
    found = sorted(last_get[rid] - at for rid, at in due if rid in seen and rid in last_get)
    landing = sorted(seen[rid] - last_get[rid] for rid, _ in due if rid in seen)
    counted = [t for t in gets if t < cutoff]
    loop = loop_requests([min(t, cutoff - start) for t in done], period_s=1 / k)
    ratio = len(counted) / loop
    busiest = busiest_window(gets)
    p99 = common.percentile(delays, 99)
    limit_s = 60 / k + TARGET_EXTRA_S
    print(
        f"ids done by the {args.live_seconds:g} s cutoff: {len(due)}, rows for "
        f"{len(due) - len(missing)}; GETs {len(counted)} vs the loop's {loop} (ratio "
        f"{ratio:.4f}); delay to row p50 {common.percentile(delays, 50):.2f} s, p99 "
        f"{p99:.2f} s; busiest second {busiest} GETs"
    )
    print(
        f"  of which completion -> the GET that found it: p50 {common.percentile(found, 50):.2f}"
        f" s, p99 {common.percentile(found, 99):.2f} s; that GET -> row: p50 "
        f"{common.percentile(landing, 50):.2f} s, p99 {common.percentile(landing, 99):.2f} s"
        f" (rows are looked for every 0.1 s)"
    )
    ok = not missing and ratio <= TARGET_RATIO and p99 <= limit_s and busiest <= rps
    print(
        f"target: ratio <= {TARGET_RATIO}; p99 <= max_interval_s + {TARGET_EXTRA_S:g} = "
        f"{limit_s:g} s; no second over {rps:g}; no row missing ({verdict(ok)})"
    )
    if missing:
        print(f"missing rows: {missing[:10]}")
        print((work / "worker0.log").read_text(errors="replace")[-3000:])
    return ok


# --- part 3: idle cost of pending watches ------------------------------------------------


def redis_cpu_s() -> float:
    client = common.redis_db13()
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def idle_share(config: Path, log_path: Path, seconds: float) -> tuple[float, float]:
    """(worker, Redis) CPU as a share of one core over ``seconds`` of a running worker."""
    cmd = [str(common.BIN_DIR / "nopoll"), "worker", "--config", str(config)]
    proc = common.start_process(cmd, log_path=log_path)
    try:
        time.sleep(3.0)  # imports and startup are not the idle cost
        w0, r0, t0 = common.cpu_seconds(proc.pid), redis_cpu_s(), time.monotonic()
        time.sleep(seconds)
        w1, r1, t1 = common.cpu_seconds(proc.pid), redis_cpu_s(), time.monotonic()
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited: {log_path.read_text()[-2000:]}")
    finally:
        common.stop_process(proc)
    return (w1 - w0) / (t1 - t0), (r1 - r0) / (t1 - t0)


def part_idle(args: argparse.Namespace, work: Path) -> bool:
    print(f"\n== 3. idle: one worker, then with {args.idle_n} watches not due for an hour")
    common.flush_bench_db()
    watch = {"first_poll_s": 3600, "max_interval_s": 3600}
    config = live_config(work / "idle.yaml", "http://127.0.0.1:9/v1", watch, work / "data")
    base_w, base_r = idle_share(config, work / "idle0.log", args.idle_seconds)
    ids = "\n".join(f"resp_idle{i:06d}" for i in range(args.idle_n))
    cmd = [str(common.BIN_DIR / "nopoll"), "watch", "--config", str(config)]
    subprocess.run(
        [*cmd, "sim", "response", "--from", "-"],
        input=ids.encode(),
        check=True,
        timeout=120,
        stdout=subprocess.DEVNULL,
    )
    with_w, with_r = idle_share(config, work / "idle1.log", args.idle_seconds)
    print(f"no watches:        worker {base_w:.2%} of a core, Redis {base_r:.2%}")
    print(f"{args.idle_n} pending: worker {with_w:.2%} of a core, Redis {with_r:.2%}")
    cost = (with_w + with_r) - (base_w + base_r)
    ok = cost < TARGET_IDLE_CORE
    print(
        f"target: what the pending watches add (worker + Redis) < {TARGET_IDLE_CORE:.0%} of "
        f"a core: {cost:+.2%} ({verdict(ok)}; the worker's own idle cost, polling its job "
        f"queue every worker.poll_delay_s, is the baseline)"
    )
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=10_000, help="ids in the schedule model")
    p.add_argument("--rps", type=float, default=250.0, help="rate limit for --n ids")
    p.add_argument("--submit-s", type=float, default=10.0, help="ids registered over this")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--live-n", type=int, default=1000)
    p.add_argument("--live-scale", type=float, default=10.0, help="clock compression")
    p.add_argument("--live-seconds", type=float, default=120.0, help="real seconds polled")
    p.add_argument("--idle-n", type=int, default=10_000)
    p.add_argument("--idle-seconds", type=float, default=20.0)
    p.add_argument("--skip-live", action="store_true")
    p.add_argument("--skip-idle", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--simulator"]:
        return serve_simulator(int(argv[1]), Path(argv[2]), Path(argv[3]))
    args = parse_args(argv)
    print(common.load_note())
    ok = part_schedule(args)
    with tempfile.TemporaryDirectory(prefix="nopoll-bench-watch-") as tmp:
        if not args.skip_live:
            ok = part_live(args, Path(tmp)) and ok
        if not args.skip_idle:
            ok = part_idle(args, Path(tmp)) and ok
    print(f"\n{'all targets met' if ok else 'a target was missed'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
